"""The dense families (families/dense/: attention through transformers' interface, a gated MLP per token; Llama,
Mistral, Ministral, Qwen2) under Ulysses SP equal stock transformers, and what the trainer cannot run of them is
refused in one line.

The harness is tests/test_qwen3_5.py's (threads as ranks, the stock model one forward per packed document with
SDPA, F.cross_entropy over the trained targets; fp32 on the CPU: loss rel <= 1e-5, every gradient
||g - g_ref|| / ||g_ref|| <= 1e-5). The models are the tiny presets with a 503-token vocabulary: 2 layers of hidden
64, 8 q / 2 kv heads (sp=4 replicates KV); tiny-llama with llama3 RoPE scaling, tiny-mistral with a 16-token sliding
window (shorter than the documents, so it cuts every long one: the stock model run one document at a time is what
"documents kept apart inside a window" means), tiny-qwen2 with q/k/v biases (and once with its second layer
windowed, as Qwen2's layer_types allow), tiny-ministral with its first layer windowed and its second full.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.sp_rank import trainer_path_matches
from tests.test_qwen3_5 import assert_equal, batch, build, lora_model, reference, sp_run
from ulysses_trainer.errors import ConfigError

# Qwen2 with its second layer windowed (16 tokens) and the first full, as its layer_types allow
MIXED = {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 16}
# sp 1, 2, 4; packed documents (one shorter than the window after one longer, one crossing a rank boundary);
# assistant-only style masks (the first third of each document not trained on)
CASES = [
    ("tiny-llama", 1, None, False, {}),
    ("tiny-llama", 2, [30, 41], True, {}),
    ("tiny-llama", 4, [9, 50, 12], False, {}),
    ("tiny-mistral", 1, [40, 31], False, {}),
    ("tiny-mistral", 2, [9, 50, 12], True, {}),  # a short document right before a long one: its window stops there
    ("tiny-mistral", 4, None, False, {}),  # one 67-token document and a pad: windows across rank boundaries
    ("tiny-ministral", 2, [9, 50, 12], True, {}),  # its first layer windowed, its second full
    ("tiny-ministral", 4, None, False, {}),
    ("tiny-qwen2", 1, [30, 41], True, {}),
    ("tiny-qwen2", 2, None, False, {}),
    ("tiny-qwen2", 4, [9, 50, 12], True, MIXED),
]


@pytest.mark.parametrize("preset, sp_size, docs, masked, overrides", CASES)
def test_sp_equals_stock_transformers(preset, sp_size, docs, masked, overrides):
    length = sum(docs) if docs else 67  # 67: padded to 68 (sp 2, 4)
    ids, pos, labels = batch(length, docs, seed=sp_size, masked=masked)
    ref = reference(build(preset, **overrides), ids, pos, labels)
    assert_equal(sp_run([build(preset, **overrides) for _ in range(sp_size)], ids, pos, labels), ref)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mistral", "tiny-ministral", "tiny-qwen2"])
def test_levers_change_memory_not_results(preset):
    # checkpointing with every input offloaded to the host pool, checkpoint_every 2, the MLP in 3 tiles
    ids, pos, labels = batch(70, [33, 37], seed=5, masked=True)
    ref = reference(build(preset), ids, pos, labels)
    levers = dict(gradient_checkpointing=True, activation_offload=True, checkpoint_every=2, tiled_mlp=3)
    assert_equal(sp_run([build(preset) for _ in range(2)], ids, pos, labels, **levers), ref)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-ministral"])
def test_the_trainers_model_path_matches_transformers(preset):
    """The trainer's own path (model_config_for -> plan_for -> build_model -> parallelize with the plan's levers)
    on a 48-token row (3 windows of tiny-mistral): one forward/backward = the stock model's."""
    trainer_path_matches(preset, 48)


def test_the_window_is_applied():
    """What the Mistral cases prove is the window: without it the same weights give another loss; the mixed Qwen2
    case windows its second layer only, tiny-ministral its first."""
    ids, pos, labels = batch(71, [9, 50, 12], seed=2)
    windowed = reference(build("tiny-mistral"), ids, pos, labels)[0]
    unwindowed = reference(build("tiny-mistral", sliding_window=None), ids, pos, labels)[0]
    assert abs(windowed - unwindowed) / abs(windowed) > 1e-4, (windowed, unwindowed)
    mixed = build("tiny-qwen2", **MIXED).model.layers
    assert (mixed[0].self_attn.sliding_window, mixed[1].self_attn.sliding_window) == (None, 16)
    ministral = build("tiny-ministral").model.layers
    assert (ministral[0].self_attn.sliding_window, ministral[1].self_attn.sliding_window) == (16, None)


@pytest.mark.parametrize("call_queries", [1 << 16, 10])
def test_windowed_attention_equals_a_full_mask(call_queries, monkeypatch):
    """attention/kernels.windowed_attention (block masks, documents and pads apart) against SDPA with the whole
    [s, s] mask: same document, causal, key within the window (transformers' sliding_window_overlay); all of a
    document's blocks in one call, and two blocks a call (the 23-token document: 5 blocks in 3 calls)."""
    import torch.nn.functional as F

    from ulysses_trainer.attention import windowed
    from ulysses_trainer.attention.kernels import windowed_attention

    monkeypatch.setattr(windowed, "CALL_QUERIES", call_queries)

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 44, 4, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 44, 2, 8, generator=g, requires_grad=True) for _ in range(2))
    cu, pads, window = torch.tensor([0, 7, 30, 40, 44], dtype=torch.int32), ((40, 44),), 5
    out = windowed_attention(q, k, v, scale=0.3, window=window, cu_seqlens=cu, pad_spans=pads)
    doc = torch.bucketize(torch.arange(44), cu[1:], right=True)
    i, j = torch.arange(44)[:, None], torch.arange(44)[None, :]
    mask = (doc[:, None] == doc[None, :]) & (j <= i) & (j > i - window)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         scale=0.3, enable_gqa=True).transpose(1, 2)
    ref = torch.where(torch.arange(44)[None, :, None, None] < 40, ref, 0.0)  # the pad's output is 0
    assert torch.allclose(out, ref, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("preset, sp_size", [("tiny-llama", 2), ("tiny-mistral", 4), ("tiny-qwen2", 2),
                                             ("tiny-ministral", 2)])
def test_lora_under_sp_equals_stock_peft(preset, sp_size):
    """LoRA on all-linear: the adapters' loss and gradients (the only ones: the base weights are frozen) under SP
    equal the stock PEFT model's, packed masked rows."""
    ids, pos, labels = batch(71, [9, 50, 12], seed=2, masked=True)
    ref = reference(lora_model(preset), ids, pos, labels)
    assert len(ref[1]) == 2 * 7 * 2 and all("lora_" in n for n in ref[1])  # 2 layers x 7 Linears x (A, B)
    assert_equal(sp_run([lora_model(preset) for _ in range(sp_size)], ids, pos, labels), ref)


def test_llama3_rope_scaling_is_the_models_own():
    """The tiny preset's llama3 scaling changes the rotary frequencies (so the exactness above covers it): HF
    computes them from the config, on every rank from its own position_ids."""
    scaled, plain = build("tiny-llama"), build("tiny-llama", rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 500_000.0})
    assert scaled.model.rotary_emb.rope_type == "llama3"
    plain.model.rotary_emb.__init__(plain.config)  # the override above is read when the embedding is built
    assert not torch.allclose(scaled.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)


# published parameter counts (the model cards round these: Llama 3.1 8B, 70B; Mistral Small 24B; Qwen2.5-7B 7.61B,
# 6.53B without the embeddings)
PUBLISHED = {"llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496, "mistral-small-24b": 23_572_403_200,
             "qwen2.5-7b": 7_615_616_512}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_count_the_published_sizes(name):
    """The preset built on the meta device holds the published count (q/k/v biases included for Qwen2), and the
    planner counts the same."""
    from transformers import AutoModelForCausalLM

    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.plan.counts import num_params
    from ulysses_trainer.plan.inputs import ModelShape

    config = preset_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    built = sum(p.numel() for p in model.parameters())
    assert built == PUBLISHED[name] == num_params(ModelShape.from_config(config))  # the planner counts what is built


def test_the_plan_command_plans_llama_3_1_8b(capsys):
    from ulysses_trainer.__main__ import main as cli_main

    assert cli_main(["plan", "--model", "llama-3.1-8b", "--max_length", "131072", "--gpus", "8",
                     "--gpu_memory_gb", "139.8", "--host_memory_gb", "560", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["estimate"]["parameters"] == PUBLISHED["llama-3.1-8b"]


def _plan_exit(capsys, model: str, *args: str) -> tuple[int, str]:
    from ulysses_trainer.__main__ import main as cli_main

    capsys.readouterr()  # what came before (a checkpoint's save) is not the command's
    code = cli_main(["plan", "--model", model, "--max_length", "4096", "--gpu_memory_gb", "80",
                     "--host_memory_gb", "64", *args])
    return code, capsys.readouterr().err


def _save(tmp_path, config) -> str:
    """A tiny checkpoint saved with transformers' own classes (random weights)."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / config.model_type
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def test_sp_not_dividing_the_heads_is_one_line(capsys):
    code, err = _plan_exit(capsys, "tiny-llama", "--gpus", "3")
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and "heads" in err, err


def test_a_llama_flag_the_trainer_does_not_run_is_refused(tmp_path, capsys):
    from ulysses_trainer.families.presets import preset_config

    config = preset_config("tiny-llama")
    config.mlp_bias = True
    code, err = _plan_exit(capsys, _save(tmp_path, config), "--gpus", "2")
    assert code == 2 and err.count("\n") == 1 and "mlp_bias" in err, err


def test_a_layer_type_without_a_ulysses_path_is_refused_naming_it():
    """A config whose layer_types holds a sequence mixer the trainer has no Ulysses path for: refused before any
    work, naming the layer type (it would train with wrong gradients under SP)."""
    from ulysses_trainer.families import family
    from ulysses_trainer.families.presets import preset_config

    config = preset_config("tiny-llama")
    assert family("llama").check_config(config) is None
    config.layer_types = ["full_attention", "linear_attention"]
    why = family("llama").check_config(config)
    assert why and "'linear_attention'" in why and "\n" not in why
    qwen2 = preset_config("tiny-qwen2")
    qwen2.layer_types = ["full_attention", "sliding_attention"]  # a window it runs exactly
    assert family("qwen2").check_config(qwen2) is None
    qwen2.layer_types = ["conv", "full_attention"]
    assert "'conv'" in family("qwen2").check_config(qwen2)


def test_a_checkpoint_with_such_a_layer_is_refused_by_the_command(tmp_path, capsys):
    """The same refusal from `plan` on a saved checkpoint: exit 2, one line naming the layer type."""
    from ulysses_trainer.families.presets import preset_config

    path = _save(tmp_path, preset_config("tiny-qwen2"))
    config = json.loads((tmp_path / "qwen2" / "config.json").read_text())
    config["layer_types"] = ["full_attention", "linear_attention"]
    (tmp_path / "qwen2" / "config.json").write_text(json.dumps(config))
    code, err = _plan_exit(capsys, path, "--gpus", "2")
    assert code == 2 and err.count("\n") == 1 and "layer type 'linear_attention'" in err, err


def test_an_architecture_without_a_family_is_refused_naming_the_supported_ones(tmp_path, capsys):
    from transformers import StableLmConfig

    config = StableLmConfig(vocab_size=503, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2)
    code, err = _plan_exit(capsys, _save(tmp_path, config), "--gpus", "1")
    assert code == 2 and err.count("\n") == 1, err
    assert "model_type 'stablelm'" in err and "llama" in err and "docs/models.md" in err, err


def test_the_presets_refuse_nothing_of_their_own():
    from ulysses_trainer.families import FAMILIES
    from ulysses_trainer.families.presets import preset_config

    for model_type in ("llama", "mistral", "ministral", "qwen2"):
        for name in FAMILIES[model_type].presets:
            assert FAMILIES[model_type].check_config(preset_config(name)) is None, name


def test_tiny_presets_keep_the_qwen_vocabulary_and_replicate_kv_at_sp4():
    from ulysses_trainer.families.presets import preset_config

    for name in ("tiny-llama", "tiny-mistral", "tiny-ministral", "tiny-qwen2"):
        c = preset_config(name)
        assert c.vocab_size == 151936 and c.num_attention_heads == 8 and c.num_key_value_heads == 2, name
    with pytest.raises(ConfigError, match="unknown model preset"):
        preset_config("tiny-llama-2")


@pytest.mark.slow
def test_train_sp1_sp2_same_losses_and_the_export_loads_as_mistral(tmp_path):
    """`deepspeed --num_gpus N launch/train.py`'s ranks (tests/warm_ranks.py) on tiny-mistral, fp32, 2 steps on
    126-token rows (the data's documents packed; a 16-token window cuts the long ones): the same losses at
    world = sp 1 and 2 (1e-4 relative); final/ loads with AutoModelForCausalLM as MistralForCausalLM, its window
    kept, and generates."""
    from transformers import AutoModelForCausalLM, MistralForCausalLM

    from tests.dist_utils import JOB_TIMEOUT_S, job_failure
    from tests.warm_ranks import run_trainer

    args = ["--model_name_or_path", "tiny-mistral", "--max_length", "126", "--max_steps", "2", "--bf16", "false",
            "--seed", "3", "--logging_steps", "1", "--learning_rate", "1e-3"]
    rows = {}
    for n in (1, 2):
        out = tmp_path / f"sp{n}"
        proc = run_trainer(n, [*args, "--output_dir", str(out)], timeout=JOB_TIMEOUT_S)
        assert proc.returncode == 0, job_failure(proc)
        rows[n] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows[1]] == [1, 2]
    for ref, got in zip(rows[1], rows[2], strict=True):
        assert abs(got["loss"] - ref["loss"]) <= 1e-4 * abs(ref["loss"]), (ref["step"], got["loss"], ref["loss"])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sp2" / "final", dtype=torch.float32)
    assert isinstance(model, MistralForCausalLM) and model.config.sliding_window == 16
    ids = torch.tensor([[151643, 40, 1079, 264]])
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 7)


def test_the_plan_says_how_it_counts_windowed_layers(capsys):
    """One note names the windowed layers and what the plan assumed of them (the block path's FLOPs, at the planned
    kernel's rate away from the measured window; memory as full attention); a model without a window has none."""
    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.plan.inputs import ModelShape

    assert ModelShape.from_config(preset_config("tiny-mistral")).windowed_layers == (0, 1)
    assert ModelShape.from_config(preset_config("tiny-ministral")).windowed_layers == (0,)
    assert ModelShape.from_config(preset_config("tiny-qwen2")).windowed_layers == ()
    from ulysses_trainer.__main__ import main as cli_main

    for preset, note in (("tiny-mistral", "2 of 2 layers attend in a 16-token sliding window"),
                         ("tiny-llama", None)):
        code = cli_main(["plan", "--model", preset, "--max_length", "4096", "--gpus", "2", "--gpu_memory_gb", "80",
                         "--host_memory_gb", "64", "--json"])
        notes = [n for n in json.loads(capsys.readouterr().out)["plan"]["notes"] if "sliding window" in n]
        assert code == 0 and notes == ([f"{note}: timed as the block path runs them (each window of queries "
                                        f"against 2 x window keys) at the planned kernel's rate (the block path "
                                        f"measured at window 128 only: an optimistic guess); their memory planned "
                                        f"as full causal attention (over-estimated)"] if note else []), notes
