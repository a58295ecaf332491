"""Granite, OLMo 2 and Phi-3 (families/granite/, olmo2/, phi3/) under Ulysses SP equal stock transformers, the planner
counts what is built, and what the trainer cannot run of them is refused in one line.

The harness is tests/test_qwen3_5.py's (threads as ranks, fp32 on the CPU: loss rel <= 1e-5, every gradient
||g - g_ref|| / ||g_ref|| <= 1e-5) on the tiny presets with a 503-token vocabulary. Granite and OLMo 2 are compared
with the stock model run one document at a time. Phi-3's LongRoPE picks its long or short factors by the longest
position of the forward, so its reference is stock transformers' forward of the whole packed row with its
position_ids (transformers keeps the packed documents apart from position_ids: `test_the_row_reference_keeps_
documents_apart` checks it against the per-document one on a RoPE that does not depend on the length).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.test_qwen3_5 import IGNORE, assert_equal, batch, build, lora_model, reference, sp_run
from ulysses_trainer.errors import ConfigError


def row_reference(model, ids, pos, labels):
    """Stock transformers, one forward of the whole packed row (position_ids restart per document): (loss, grads)."""
    logits = model(input_ids=ids, position_ids=pos).logits.float()[0]
    target = labels[0, 1:].clone()
    target[pos[0, 1:] == 0] = IGNORE  # no target across a document start
    loss = F.cross_entropy(logits[:-1], target, reduction="sum", ignore_index=IGNORE) / int((target != IGNORE).sum())
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                  if p.grad is not None}


REFERENCE = {"tiny-granite": reference, "tiny-olmo2": reference, "tiny-phi3": row_reference}
# sp 1, 2, 4; packed documents (one crossing a rank boundary); assistant-only style masks (a third of each document
# a prompt). Phi-3: [30, 41] at sp 2 puts positions 0..29, 0..5 on rank 0 (under LongRoPE's 32 original positions:
# short factors alone) and 6..40 on rank 1: the row's choice (long) must reach rank 0 too
CASES = [
    ("tiny-granite", 1, [30, 41], True, {}),
    ("tiny-granite", 2, None, False, {}),
    ("tiny-granite", 4, [9, 50, 12], True, {}),
    ("tiny-olmo2", 1, None, True, {}),
    ("tiny-olmo2", 2, [30, 41], True, {}),
    ("tiny-olmo2", 4, [9, 50, 12], False, {}),
    ("tiny-phi3", 1, [9, 50, 12], True, {}),
    ("tiny-phi3", 2, [30, 41], True, {}),
    ("tiny-phi3", 4, None, False, {"sliding_window": 16}),  # a window, as stock applies Phi-3's sliding_window
]


@pytest.mark.parametrize("preset, sp_size, docs, masked, overrides", CASES)
def test_sp_equals_stock_transformers(preset, sp_size, docs, masked, overrides):
    length = sum(docs) if docs else 67  # 67: padded to 68 (sp 2, 4)
    ids, pos, labels = batch(length, docs, seed=sp_size, masked=masked)
    ref = REFERENCE[preset](build(preset, **overrides), ids, pos, labels)
    assert_equal(sp_run([build(preset, **overrides) for _ in range(sp_size)], ids, pos, labels), ref)


@pytest.mark.parametrize("preset", ["tiny-granite", "tiny-olmo2", "tiny-phi3"])
def test_levers_change_memory_not_results(preset):
    # checkpointing with every input offloaded to the host pool, checkpoint_every 2, the MLP in 3 tiles (Phi-3: its
    # fused gate_up_proj, modules.TiledFusedMLP)
    ids, pos, labels = batch(70, [33, 37], seed=5, masked=True)
    ref = REFERENCE[preset](build(preset), ids, pos, labels)
    levers = dict(gradient_checkpointing=True, activation_offload=True, checkpoint_every=2, tiled_mlp=3)
    assert_equal(sp_run([build(preset) for _ in range(2)], ids, pos, labels, **levers), ref)


def test_dynamic_rope_is_chosen_on_the_row_too():
    """Dynamic NTK scaling also rescales by the longest position of the forward (past max_position_embeddings 32
    here): under SP 2 the row's choice, as stock's forward of the row (model/row_rope.py wraps any such RoPE)."""
    dynamic = {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10_000.0, "factor": 2.0},
               "max_position_embeddings": 32}
    ids, pos, labels = batch(71, [30, 41], seed=4, masked=True)
    ref = row_reference(build("tiny-llama", **dynamic), ids, pos, labels)
    assert _largest_grad_error(reference(build("tiny-llama", **dynamic), ids, pos, labels), ref) > 1e-3
    assert_equal(sp_run([build("tiny-llama", **dynamic) for _ in range(2)], ids, pos, labels), ref)


def test_the_row_reference_keeps_documents_apart():
    """Stock transformers' forward of a packed row with position_ids equals its forward one document at a time
    (a RoPE that does not depend on the length): the Phi-3 reference keeps documents apart."""
    ids, pos, labels = batch(71, [9, 50, 12], seed=2, masked=True)
    default = {"rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}}
    row, per_doc = row_reference(build("tiny-phi3", **default), ids, pos, labels), \
        reference(build("tiny-phi3", **default), ids, pos, labels)
    assert_equal(row, per_doc)


def test_what_the_cases_prove_is_each_familys_own():
    """Each special piece changes the result, so the exactness above covers it: Granite's logits_scaling (the loss
    head divides the logits), LongRoPE's row-wide choice (per document the short factors would be taken), Phi-3's
    window."""
    ids, pos, labels = batch(71, [30, 41], seed=2, masked=True)
    scaled = reference(build("tiny-granite"), ids, pos, labels)[0]
    unscaled = reference(build("tiny-granite", logits_scaling=1.0), ids, pos, labels)[0]
    assert abs(scaled - unscaled) / scaled > 1e-3, (scaled, unscaled)
    row = row_reference(build("tiny-phi3"), ids, pos, labels)
    per_doc = reference(build("tiny-phi3"), ids, pos, labels)  # its 30-token document: the short factors
    windowed = row_reference(build("tiny-phi3", sliding_window=16), ids, pos, labels)
    for other in (per_doc, windowed):
        assert _largest_grad_error(other, row) > 1e-3


def _largest_grad_error(got, ref) -> float:
    return max(float(torch.linalg.norm(got[1][n] - g) / torch.linalg.norm(g)) for n, g in ref[1].items())


@pytest.mark.parametrize("preset", ["tiny-granite", "tiny-olmo2"])
def test_lora_under_sp_equals_stock_peft(preset):
    """LoRA on all-linear (Granite's multipliers and OLMo 2's post-norms around the adapted Linears): the adapters'
    loss and gradients under SP 2, the MLP in 3 tiles, equal the stock PEFT model's on packed masked rows."""
    ids, pos, labels = batch(71, [9, 50, 12], seed=2, masked=True)
    ref = reference(lora_model(preset), ids, pos, labels)
    assert len(ref[1]) == 2 * 7 * 2 and all("lora_" in n for n in ref[1])  # 2 layers x 7 Linears x (A, B)
    assert_equal(sp_run([lora_model(preset) for _ in range(2)], ids, pos, labels, tiled_mlp=3), ref)


def test_lora_on_phi3s_fused_projections_under_sp_equals_stock_peft():
    """all-linear on Phi-3 is its fused names (qkv_proj, o_proj, gate_up_proj, down_proj); the adapters' loss and
    gradients under SP 2 with the MLP tiled equal the stock PEFT model's on packed masked rows."""
    ids, pos, labels = batch(71, [30, 41], seed=2, masked=True)
    ref = row_reference(lora_model("tiny-phi3"), ids, pos, labels)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in ref[1]}
    assert adapted == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} and len(ref[1]) == 2 * 4 * 2
    assert_equal(sp_run([lora_model("tiny-phi3") for _ in range(2)], ids, pos, labels, tiled_mlp=3), ref)


@pytest.mark.parametrize("targets", [None, "all-linear"])
def test_the_plan_counts_the_adapters_peft_makes_on_phi3(targets):
    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.model.load import build_model, model_config_for
    from ulysses_trainer.model.lora import add_lora
    from ulysses_trainer.plan.inputs import ModelShape
    from ulysses_trainer.plan.partitions import lora_numels

    cfg = TrainConfig(model_name_or_path="tiny-phi3", use_peft=True, lora_r=4, lora_target_modules=targets,
                      lora_dropout=0.0)
    mc = model_config_for(cfg)
    _, peft_model = add_lora(build_model(mc, torch.float32, None, seed=0), cfg)
    trainable = sorted(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert trainable == sorted(lora_numels(ModelShape.from_config(mc), targets, 4))


def test_lora_targets_phi3_has_not_are_refused_naming_its_own():
    from ulysses_trainer.families import family

    with pytest.raises(ConfigError, match="no such Linear.*qkv_proj, o_proj, gate_up_proj, down_proj"):
        family("phi3").lora_targets(["q_proj", "v_proj"])
    assert family("phi3").lora_targets(None) == ("qkv_proj",)


@pytest.mark.parametrize("preset", ["tiny-olmo2", "tiny-phi3"])
def test_the_trainers_model_path_matches_transformers_olmo2_phi3(preset):
    """The same path on OLMo 2 (post-norms, the recompute rule the plan sets) and Phi-3 (fused projections, LongRoPE
    past its 32 original positions on the 48-token row): one forward/backward = the stock model's."""
    from tests.sp_rank import trainer_path_matches

    trainer_path_matches(preset, 48)


def test_the_trainers_model_path_matches_transformers():
    """The trainer's own path (tests/sp_rank.trainer_path_matches: model_config_for -> plan_for -> build_model ->
    parallelize with the plan's levers) on Granite: one forward/backward = the stock model's, and its logits (the
    loss head divides them by logits_scaling) = the stock head's."""
    from tests.sp_rank import trainer_path_matches
    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.model.load import build_model, model_config_for

    sp_model = trainer_path_matches("tiny-granite", 48)
    ids = torch.randint(0, 1000, (1, 48), generator=torch.Generator().manual_seed(3))
    stock = build_model(model_config_for(TrainConfig(model_name_or_path="tiny-granite", max_length=48)),
                        torch.float32, seed=5)
    with torch.no_grad():
        assert torch.allclose(sp_model.logits(ids), stock(input_ids=ids).logits.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("preset", ["tiny-granite", "tiny-olmo2", "tiny-phi3", "granite-3.1-8b", "olmo-2-7b",
                                    "phi-3.5-mini"])
def test_the_planner_counts_what_is_built(preset):
    """Every parameter the built model holds, and every tensor in the order the model holds them (what ZeRO-3's
    partitions and sub-groups follow; Phi-3 registers o_proj before qkv_proj)."""
    from transformers import AutoModelForCausalLM

    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.plan.counts import layer_param_numels, num_params, param_numels
    from ulysses_trainer.plan.inputs import ModelShape

    config = preset_config(preset)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == num_params(shape)
    assert [p.numel() for p in model.model.layers[0].parameters()] == layer_param_numels(shape)
    assert [p.numel() for p in model.parameters()] == param_numels(shape)


# the published sizes (model cards: Granite-3.1-8B 8.17B, OLMo-2-1124-7B 7.30B, Phi-3.5-mini 3.82B)
PUBLISHED = {"granite-3.1-8b": 8_170_848_256, "olmo-2-7b": 7_298_617_344, "phi-3.5-mini": 3_821_079_552}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_plan_command_plans_the_real_shapes_at_1m_on_8_gpus(name, capsys):
    from ulysses_trainer.__main__ import main as cli_main

    assert cli_main(["plan", "--model", name, "--max_length", "1048576", "--gpus", "8", "--gpu_memory_gb", "139.8",
                     "--host_memory_gb", "1800", "--allow_beyond_positions", "true", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["estimate"]["parameters"] == PUBLISHED[name]


def test_olmo2s_q_k_norms_span_the_whole_projection():
    """OLMo 2's q_norm / k_norm are as wide as the projections (Qwen3's: one head), and the planner counts them so."""
    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.plan.inputs import ModelShape

    model = build("tiny-olmo2")
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.numel() == attn.q_proj.out_features == 64 and attn.k_norm.weight.numel() == 16
    numels = ModelShape.from_config(preset_config("tiny-olmo2")).numels
    assert (numels["q_norm"], numels["k_norm"], numels["post_feedforward_norm"]) == (64, 16, 64)


def _plan_exit(capsys, model: str, *args: str) -> tuple[int, str]:
    from ulysses_trainer.__main__ import main as cli_main

    capsys.readouterr()
    code = cli_main(["plan", "--model", model, "--max_length", "4096", "--gpu_memory_gb", "80",
                     "--host_memory_gb", "64", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("preset, field, value", [("tiny-phi3", "resid_pdrop", 0.1), ("tiny-granite", "mlp_bias", True),
                                                  ("tiny-olmo2", "attention_bias", True)])
def test_what_the_trainer_cannot_run_is_refused_in_one_line(tmp_path, capsys, preset, field, value):
    """A checkpoint whose config sets what the trainer does not run as it counts (Phi-3's residual dropout: each
    rank would draw its own masks; Granite's MLP biases; OLMo 2's attention biases): exit 2, one line naming it."""
    from transformers import AutoModelForCausalLM

    from ulysses_trainer.families.presets import preset_config

    config = preset_config(preset)
    config.vocab_size = 503
    setattr(config, field, value)
    path = tmp_path / preset
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    code, err = _plan_exit(capsys, str(path), "--gpus", "2")
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and field in err, err


def test_the_presets_refuse_nothing_of_their_own():
    from ulysses_trainer.families import FAMILIES
    from ulysses_trainer.families.presets import preset_config

    for model_type in ("granite", "olmo2", "phi3"):
        for name in FAMILIES[model_type].presets:
            assert FAMILIES[model_type].check_config(preset_config(name)) is None, name


def test_olmo2s_lean_norms_are_its_own_norms_in_bf16():
    """OLMo 2's RMSNorm multiplies the weight in fp32 and casts after (Qwen3's casts first): the lean norm the
    family installs (norm_fp32_weight) gives its bf16 output bitwise and its gradients to bf16 rounding; the
    Qwen3-style one does not give its output."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from ulysses_trainer.families import family
    from ulysses_trainer.levers.lean_norm import LeanRMSNorm

    gen = torch.Generator().manual_seed(0)
    hf = Olmo2RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.3 * torch.randn(64, generator=gen))
    x = (3 * torch.randn(5, 37, 64, generator=gen)).to(torch.bfloat16)
    g = torch.randn(5, 37, 64, generator=gen).to(torch.bfloat16)

    def run(norm):
        xi = x.clone().requires_grad_(True)
        out = norm(xi)
        out.backward(g)
        grads = (xi.grad.float(), norm.weight.grad.float())
        norm.weight.grad = None
        return out.detach(), grads

    ref_out, (ref_gx, ref_gw) = run(hf)
    out, (gx, gw) = run(LeanRMSNorm(hf, "torch", family("olmo2").norm_offset, family("olmo2").norm_fp32_weight))
    assert torch.equal(out, ref_out)
    assert (gx - ref_gx).norm() <= 1e-2 * ref_gx.norm() and (gw - ref_gw).norm() <= 1e-2 * ref_gw.norm()
    assert not torch.equal(LeanRMSNorm(hf, "torch")(x), ref_out)


@pytest.mark.parametrize("preset", ["tiny-phi3", "tiny-granite"])
def test_verify_sp_passes_them(preset):
    """verify_sp (train/verify_sp.py) at sp 2 on a packed row: Granite's logits_scaling; Phi-3's LongRoPE, where
    the stock reference is the row's forward (one process picks the factors on the whole row, as the trainer does;
    per document its 30-token one would take the short ones)."""
    from tests.test_verify_sp import _check, _row

    out = _check(build(preset, seed=1), lambda: build(preset, seed=1), _row(64, 503, [30, 34]), 2)
    for result in out:
        assert not isinstance(result, Exception), result
        assert abs(result.loss - result.ref_loss) <= 1e-5 * abs(result.ref_loss) and result.worst <= 1e-5


def test_the_per_position_loss_divides_granites_logits():
    """The per-position loss plot's NLLs (train/diagnostics.per_token_losses, given the loss head's
    logits_scaling) are stock Granite's per-token cross-entropy."""
    from ulysses_trainer.train.diagnostics import per_token_losses

    model = build("tiny-granite")
    ids, _, labels = batch(40, None, seed=3)
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        want = F.cross_entropy(model(input_ids=ids).logits[0, :-1], labels[0, 1:], reduction="none")
    got = per_token_losses(hidden[:, :-1], model.lm_head.weight, labels[:, 1:], chunk=7,
                           logits_scaling=model.config.logits_scaling)
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-6)


def test_row_rope_keeps_the_module_and_unparallelize_removes_it():
    """The row's RoPE is the rotary embedding's own forward: its buffers keep their names (verify_sp copies the
    running model's buffers into a stock one by name), and unparallelize gives the stock forward back."""
    from ulysses_trainer import ParallelizeConfig, parallelize, unparallelize
    from ulysses_trainer.parallel.state import single_process_state

    model = build("tiny-phi3")
    names = [n for n, _ in model.named_buffers()]
    sp_model = parallelize(model, single_process_state(), ParallelizeConfig(attn_implementation="sdpa"))
    assert "forward" in model.model.rotary_emb.__dict__
    assert [n.removeprefix("causal_lm.") for n, _ in sp_model.named_buffers()] == names
    assert "forward" not in unparallelize(sp_model).model.rotary_emb.__dict__
