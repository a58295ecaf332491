"""Gemma 3 (families/gemma3/: gemma3_text) under Ulysses SP equals stock transformers, its sliding and global layers
each with their own RoPE, its (1 + weight) norms, scaled embedding, GELU-tanh MLP and query_pre_attn_scalar; the
final-logit soft-capping inside the chunked loss; the planner's counts, order and window-limited attention FLOPs;
what it refuses, in one line.

The harness is tests/test_qwen3_5.py's (threads as ranks, the stock model one forward per packed document with
SDPA, F.cross_entropy over the trained targets; fp32 on the CPU: loss rel <= 1e-5, every gradient
||g - g_ref|| / ||g_ref|| <= 1e-5). The model is tiny-gemma3 with a 503-token vocabulary: a sliding layer (16-token
window, shorter than the long documents, so the stock model run one document at a time is what "documents kept
apart inside a window" means) and a global one, 8 q / 2 kv heads of 16 (sp=4 replicates KV).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tests.sp_rank import trainer_path_matches
from tests.test_qwen3_5 import assert_equal, batch, build, lora_model, reference, sp_run
from ulysses_trainer.vocabulary.layout import Layout

PRESET = "tiny-gemma3"
# sp 1, 2, 4; packed documents: one inside a window (9 tokens), one across windows and the rank boundary (50), one
# after it; 67 tokens unpacked (a pad at sp 2, 4); assistant-only style masks (the first third of each document)
CASES = [
    (1, [30, 41], True),
    (2, [9, 50, 12], True),
    (4, None, False),
    (4, [20, 51], True),
]


@pytest.mark.parametrize("sp_size, docs, masked", CASES)
def test_sp_equals_stock_transformers(sp_size, docs, masked):
    length = sum(docs) if docs else 67
    ids, pos, labels = batch(length, docs, seed=sp_size, masked=masked)
    ref = reference(build(PRESET), ids, pos, labels)
    assert_equal(sp_run([build(PRESET) for _ in range(sp_size)], ids, pos, labels), ref)


def test_levers_change_memory_not_results():
    # checkpointing with every input offloaded to the host pool, checkpoint_every 2, the GELU-tanh MLP in 3 tiles
    ids, pos, labels = batch(70, [33, 37], seed=5, masked=True)
    ref = reference(build(PRESET), ids, pos, labels)
    levers = dict(gradient_checkpointing=True, activation_offload=True, checkpoint_every=2, tiled_mlp=3)
    assert_equal(sp_run([build(PRESET) for _ in range(2)], ids, pos, labels, **levers), ref)


def test_final_logit_softcapping_in_the_chunked_loss_equals_stock():
    """A config with final_logit_softcapping: stock Gemma3ForCausalLM caps its logits; the trainer's chunked loss
    (7-row chunks) caps them chunk by chunk, gradients through tanh included. A cap of 0.1 bites on these
    random weights' small logits (the loss moves)."""
    ids, pos, labels = batch(71, [9, 50, 12], seed=2, masked=True)
    ref = reference(build(PRESET, final_logit_softcapping=0.1), ids, pos, labels)
    assert abs(ref[0] - reference(build(PRESET), ids, pos, labels)[0]) > 1e-3 * ref[0]
    assert_equal(sp_run([build(PRESET, final_logit_softcapping=0.1) for _ in range(2)], ids, pos, labels), ref)


def test_the_plan_counts_the_softcapped_chunks_tanh():
    """With final_logit_softcapping the chunked loss keeps one chunk's fp32 tanh beside its logits: the plan's loss
    buffers grow by chunk x vocab x 4 bytes, and only then."""
    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.plan.inputs import ModelShape, Settings
    from ulysses_trainer.plan.loss_terms import chunked_loss_bytes

    config = preset_config(PRESET)
    plain = ModelShape.from_config(config)
    config.final_logit_softcapping = 30.0
    capped = ModelShape.from_config(config)
    s = Settings(max_length=4096)
    assert not plain.final_logit_softcap and capped.final_logit_softcap
    assert chunked_loss_bytes(capped, s) - chunked_loss_bytes(plain, s) == 256 * plain.vocab * 4


def test_the_softcapped_chunked_loss_equals_the_plain_one():
    """levers/chunked_loss with softcap against cap * tanh(logits / cap) and F.cross_entropy by autograd: the sum and
    both gradients, ignored labels included."""
    import torch.nn.functional as F

    from ulysses_trainer.levers.chunked_loss import chunked_nll_sum

    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 23, 16, generator=g, requires_grad=True)
    w = torch.randn(40, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 40, (2, 23), generator=g)
    labels[0, :5] = -100
    got = chunked_nll_sum(h, w, labels, chunk_size=4, softcap=5.0)
    gh, gw = torch.autograd.grad(got, (h, w))
    logits = torch.tanh(F.linear(h, w) / 5.0) * 5.0
    ref = F.cross_entropy(logits.reshape(-1, 40), labels.reshape(-1), ignore_index=-100, reduction="sum")
    rh, rw = torch.autograd.grad(ref, (h, w))
    assert torch.allclose(got, ref, rtol=1e-6) and torch.allclose(gh, rh, atol=1e-5) and torch.allclose(gw, rw,
                                                                                                       atol=1e-5)


def test_the_trainers_model_path_matches_transformers():
    """The trainer's own path (model_config_for -> plan_for -> build_model -> parallelize with the plan's levers)
    on a 48-token row (3 windows): one forward/backward = the stock model's, its norms the lean (1 + weight) ones."""
    sp_model = trainer_path_matches(PRESET, 48)
    norms = [m for n, m in sp_model.named_modules() if n.endswith("norm")]
    assert len(norms) == 2 * 6 + 1 and all(type(m).__name__ == "LeanRMSNorm" and m.offset == 1.0 for m in norms)


def test_the_window_and_each_layer_kinds_rope_are_applied():
    """What the cases above prove includes the window and the two RoPE bases: without the window, or with the local
    layers on the global base, the same weights give another loss; the layers are sliding then global."""
    ids, pos, labels = batch(50, None, seed=2)
    loss = reference(build(PRESET), ids, pos, labels)[0]
    unwindowed = reference(build(PRESET, sliding_window=4096), ids, pos, labels)[0]  # a window over the whole row
    from ulysses_trainer.families.gemma3 import rope

    one_base = reference(build(PRESET, rope_parameters=rope(1e6, 1e6, 8.0)), ids, pos, labels)[0]
    assert abs(loss - unwindowed) / loss > 1e-4 and abs(loss - one_base) / loss > 1e-4, (loss, unwindowed, one_base)
    layers = build(PRESET).model.layers
    assert (layers[0].self_attn.sliding_window, layers[1].self_attn.sliding_window) == (16, None)
    assert layers[0].self_attn.scaling == 24 ** -0.5  # query_pre_attn_scalar, not head_dim


def test_the_planned_layer_order_is_the_order_the_model_uses_its_parameters():
    """ModelShape's layer order (the ZeRO-3 trace, Family.layer_order and Gemma3Family.attention_params) against the
    order a stock forward first touches each parameter of a layer; the layer's parameter count likewise."""
    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.plan.inputs import ModelShape

    model = build(PRESET)
    layer, seen = model.model.layers[0], []
    short = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
             "down_proj": "down", "input_layernorm": "input_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "pre_feedforward_norm", "q_norm": "q_norm", "k_norm": "k_norm",
             "post_feedforward_layernorm": "post_feedforward_norm"}
    for name, module in layer.named_modules():
        tensor = short.get(name.split(".")[-1])
        if tensor is not None:
            module.register_forward_pre_hook(lambda m, a, n=tensor: seen.append(n))
    model(input_ids=torch.tensor([[1, 2, 3]]))
    shape = ModelShape.from_config(preset_config(PRESET))
    assert list(shape.layer_orders[0]) == list(dict.fromkeys(seen))
    assert sum(n for _, n in shape.layer_params) == sum(p.numel() for p in layer.parameters())


def test_gemma_3_27b_counts_what_transformers_builds_and_plans_at_1m_on_8_gpus(capsys):
    """The preset built on the meta device holds what the planner counts (27.0B, the language model of the 27B
    checkpoint); `plan` at 1,048,576 tokens on 8 GPUs runs (allow_beyond_positions: Gemma's positions stop at
    131,072), says how it counted the 52 sliding layers, and their window-limited attention takes less time than
    full causal attention would."""
    from transformers import AutoModelForCausalLM

    from ulysses_trainer.__main__ import main as cli_main
    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.plan.inputs import ModelShape, Settings
    from ulysses_trainer.plan.step_time import step_time

    config = preset_config("gemma-3-27b")
    with torch.device("meta"):
        built = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    shape = ModelShape.from_config(config)
    assert built == shape.num_params == 27_009_346_304
    assert len(shape.windowed_layers) == 52 and shape.sliding_window == 1024
    assert cli_main(["plan", "--model", "gemma-3-27b", "--max_length", "1048576", "--gpus", "8", "--gpu_memory_gb",
                     "139.8", "--host_memory_gb", "560", "--allow_beyond_positions", "true", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["estimate"]["parameters"] == built
    assert any("52 of 62 layers attend in a 1,024-token sliding window: timed as the block path runs them"
               in n for n in data["plan"]["notes"])
    s = Settings(max_length=1_048_576, layout=Layout(8, 8), attn_implementation="flash_attention_4")
    windowed = step_time(shape, s, shape.num_params).parts
    full = step_time(replace(shape, windowed_layers=(), sliding_window=0), s, shape.num_params).parts
    for part in ("attention forward", "attention backward"):  # 10 global layers + 52 at 4 x 1024 / 1M of full
        assert windowed[part] < 0.2 * full[part], (part, windowed[part], full[part])



def test_the_extra_norms_are_planned():
    """Gemma's block-output norms keep their inputs: a memory term a pre-norm family does not have, and two more
    norms per layer in the norm time."""
    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.plan.inputs import ModelShape, Settings, mlp_run
    from ulysses_trainer.plan.layer_terms import layer_forward_saved
    from ulysses_trainer.plan.step_time import norm_seconds

    gemma = ModelShape.from_config(preset_config(PRESET))
    llama = ModelShape.from_config(preset_config("tiny-llama"))
    s = Settings(max_length=4096)
    key = "post-attention: block-output norms (inputs)"
    assert layer_forward_saved(gemma, s)[key] == 2 * 4096 * 64 * 2 and key not in layer_forward_saved(llama, s)
    t = norm_seconds(gemma, mlp_run(gemma, s), "torch")
    assert t > norm_seconds(replace(gemma, model_type="qwen3"), mlp_run(gemma, s), "torch")


def _plan_exit(capsys, model: str, *args: str) -> tuple[int, str]:
    from ulysses_trainer.__main__ import main as cli_main

    capsys.readouterr()
    code = cli_main(["plan", "--model", model, "--gpus", "2", "--gpu_memory_gb", "80", "--host_memory_gb", "64",
                     *args])
    return code, capsys.readouterr().err


def test_attention_softcapping_and_bidirectional_attention_are_refused_in_one_line(tmp_path, capsys):
    """A checkpoint whose config sets attn_logit_softcapping (Gemma 2 style) or bidirectional attention: exit 2 from
    `plan`, one line naming the field."""
    from transformers import AutoModelForCausalLM

    from ulysses_trainer.families import family
    from ulysses_trainer.families.presets import preset_config

    assert family("gemma3_text").check_config(preset_config("gemma-3-27b")) is None
    for field, value in (("attn_logit_softcapping", 50.0), ("use_bidirectional_attention", True)):
        config = preset_config(PRESET)
        config.vocab_size = 503
        setattr(config, field, value)
        path = tmp_path / field
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        code, err = _plan_exit(capsys, str(path), "--max_length", "64")
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and field in err, err


def test_positions_past_gemmas_own_and_a_yarn_over_them_are_refused_in_one_line(capsys):
    """Past 131,072 positions the refusal names Gemma's own per-layer-type rope (the global layers' linear factor 8);
    a YaRN rope_parameters, which would replace both layer kinds' rope with one, is refused the same way."""
    code, err = _plan_exit(capsys, "gemma-3-27b", "--max_length", "262144")
    assert code == 2 and err.count("\n") == 1 and "full_attention: linear factor 8" in err, err
    assert "allow_beyond_positions" in err
    code, err = _plan_exit(capsys, "gemma-3-27b", "--max_length", "262144", "--model_init_kwargs",
                           '{"rope_parameters": {"rope_type": "yarn", "factor": "auto"}}')
    assert code == 2 and err.count("\n") == 1 and "rope_parameters" in err and "its own rope" in err, err


def test_lora_under_sp_equals_stock_peft():
    """LoRA on all-linear (r 4, B drawn non-zero): the adapters' loss and gradients (the only ones: the base weights
    are frozen) at sp 2 equal the stock PEFT model's, packed masked rows, a document across the window."""

    ids, pos, labels = batch(71, [9, 50, 12], seed=2, masked=True)
    ref = reference(lora_model(PRESET), ids, pos, labels)
    assert len(ref[1]) == 2 * 7 * 2 and all("lora_" in n for n in ref[1])  # 2 layers x 7 Linears x (A, B)
    assert_equal(sp_run([lora_model(PRESET) for _ in range(2)], ids, pos, labels), ref)
