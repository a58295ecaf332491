"""The one resolved plan (plan/resolve.py): the trainer and `ulysses-trainer plan` run the same function,
every `auto` is decided there (the fastest predicted step that fits), and the drift cases stay fixed."""

from __future__ import annotations

import contextlib
import io
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from ulysses_trainer.__main__ import main as cli_main
from ulysses_trainer.cli.argv import load_config
from ulysses_trainer.config import TrainConfig
from ulysses_trainer.ds_config import load_ds_config
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.plan.inputs import ModelShape, Settings
from ulysses_trainer.plan.rates import (
    KERNEL_RATES,
    NORM_S_PER_ELEMENT,
    ROPE_S_PER_ELEMENT,
    kernel_rates_from_results,
    norm_rates_from_results,
    rope_rates_from_results,
)
from ulysses_trainer.plan.resolve import plan_for, replan_after_engine, resolve_plan
from ulysses_trainer.plan.step_time import (
    MODELLED_FROM_S,
    format_seconds,
    step_time,
)
from ulysses_trainer.plan.types import Machine, ZeroSettings
from ulysses_trainer.vocabulary.layout import Layout
from ulysses_trainer.vocabulary.names import default_mlp_tiles

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "launch" / "recipes").glob("*.yaml"))
Q4 = ModelShape.preset("qwen3-4b")
H200 = dict(gpu_memory_gb=139.8, host_memory_gb=125.9, gpu_name="NVIDIA H200")  # one H200 and its host
YARN = ["--model_init_kwargs", '{"rope_parameters": {"rope_type": "yarn", "factor": "auto"}}']  # past 40,960 positions


def _plan(kernels=("sdpa",), norm_kernels=("torch",), **cfg):
    base = dict(model_name_or_path="qwen3-4b", max_length=262144, sp_size=1)
    machine = Machine(gpus=1, kernels=kernels, norm_kernels=norm_kernels, **H200)
    return resolve_plan(TrainConfig(**(base | cfg)), Q4, machine, ZeroSettings())


# `plan --json` = the trainer's plan for every recipe, through prepare: tests/test_plan_through_prepare.py


def test_prepare_resolves_with_plan_for():
    from ulysses_trainer.train.prepare import prepare

    cfg = load_config(["--config", str(ROOT / "launch" / "recipes" / "cpu_default.yaml")])
    run = prepare(cfg, 2)
    again = plan_for(cfg, run.model_config, load_ds_config(cfg.deepspeed), run.machine)
    assert run.resolved == again and run.attn_implementation == again.run.attn_implementation
    assert run.bf16 is again.run.bf16 is False and run.ds_config["bf16"]["enabled"] is False  # one rule: no GPU
    assert run.resolved.predicted.step_s is None  # no GPU: no time model, nothing searched


def test_activation_offload_true_with_checkpoint_every_2_plans(capsys):
    args = ["plan", "--model", "qwen3-4b", "--max_length", "131072", *YARN, "--activation_offload", "true",
            "--checkpoint_every", "2", "--gpus", "1", "--gpu_memory_gb", "139.8", "--host_memory_gb", "125.9",
            "--json"]
    assert cli_main(args) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["checkpoint_every"] == 2 and plan["offload_layers"] == list(range(0, 36, 2))  # all 18 kept inputs


def test_offload_without_checkpointing_is_refused_before_anything():
    with pytest.raises(ConfigError, match="activation_offload true needs gradient_checkpointing: true"):
        _plan(gradient_checkpointing=False, activation_offload=True)
    from ulysses_trainer.config import validate_config  # the shape-free check runs before the model is built

    with pytest.raises(ConfigError, match="set activation_offload false or gradient_checkpointing true"):
        validate_config(TrainConfig(gradient_checkpointing=False, activation_offload=2), 1)


def test_without_checkpointing_the_autos_offload_and_keep_nothing():
    plan = _plan(max_length=16384, gradient_checkpointing=False)
    assert plan.predicted.fits and (plan.saved_layers, plan.offload_layers, plan.kept_attention_layers) == ((), (), ())
    assert plan.predicted.step_s < _plan(max_length=16384).predicted.step_s  # no recompute


def test_flash_attention_2_keeps_no_attention_outputs():
    plan = _plan(kernels=("flash_attention_2", "sdpa"))
    assert plan.run.attn_implementation == "flash_attention_2" and plan.kept_attention_layers == ()
    assert "0/36 attention outputs kept" in plan.summary()
    with pytest.raises(ConfigError, match="flash_attention_2 cannot: set keep_attention_outputs false"):
        _plan(kernels=("flash_attention_2", "sdpa"), keep_attention_outputs=True)
    # packed rows keep outputs as a dense row of the same length does (one KV group at a time, the same buffers)
    assert _plan(packing=True).kept_attention_layers == _plan().kept_attention_layers != ()


def test_auto_takes_flash_attention_4_whenever_installed():
    fastest = _plan(kernels=("flash_attention_4", "flash_attention_2", "sdpa"))
    assert fastest.run.attn_implementation == "flash_attention_4"
    with pytest.raises(ConfigError, match=r"flash_attention_4.*not installed here .*\[fa4\]"):
        _plan(attn_implementation="flash_attention_4")


def test_auto_takes_the_fused_norm_kernel_where_installed_and_predicts_it_faster():
    fused, plain = _plan(norm_kernels=("triton", "torch")), _plan()
    assert (fused.run.norm_kernel, plain.run.norm_kernel) == ("triton", "torch")
    assert "norm_kernel triton" in fused.decided and "triton norms" in fused.summary()
    parts = dict(fused.predicted.step_parts)
    assert parts["RMSNorms (triton)"] < dict(plain.predicted.step_parts)["RMSNorms (torch)"]
    assert fused.predicted.step_s < plain.predicted.step_s
    with pytest.raises(ConfigError, match=r"norm_kernel='triton' is not installed here .*\[liger\]"):
        _plan(norm_kernel="triton")
    with pytest.raises(ConfigError, match="set lean_norm true or norm_kernel auto"):
        _plan(norm_kernels=("triton", "torch"), norm_kernel="triton", lean_norm=False)
    assert _plan(norm_kernels=("triton", "torch"), lean_norm=False).run.norm_kernel == "torch"  # HF's norms stay


def test_the_norm_split_leaves_the_calibrated_total_unchanged():
    from ulysses_trainer.plan.counts import num_params

    s = Settings(max_length=262144, optimizer="none").with_levers(keep_attention_outputs=36)
    lean, hf = (step_time(Q4, replace(s, lean_norm=v), num_params(Q4)) for v in (True, False))
    assert lean.total_s == pytest.approx(hf.total_s, rel=1e-12)  # the torch norms were inside the dense rate
    assert "RMSNorms (torch)" in lean.parts and "RMSNorms (torch)" not in hf.parts
    assert 0 < lean.parts["RMSNorms (torch)"] < hf.parts["matmuls and the rest"]


def test_the_lean_norm_module_refuses_a_kernel_it_cannot_run():
    import torch

    from ulysses_trainer.levers.lean_norm import LeanRMSNorm, available_norm_kernels

    norm = torch.nn.Module()
    norm.weight, norm.variance_epsilon = torch.nn.Parameter(torch.ones(8)), 1e-6
    with pytest.raises(ValueError, match="use one of triton, torch"):
        LeanRMSNorm(norm, "cuda")
    if "triton" not in available_norm_kernels() and not torch.cuda.is_available():
        assert available_norm_kernels() == ["torch"]
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            with pytest.raises(ValueError, match=r"ulysses_trainer\[liger\]"):
                LeanRMSNorm(norm, "triton")


def test_auto_chooses_the_fastest_plan_that_fits_not_the_first():
    best = _plan()
    assert best.predicted.fits and best.run.levers.optimizer_offload and len(best.kept_attention_layers) == 36
    on_gpu = _plan(optimizer_offload=False)
    assert on_gpu.predicted.fits and best.predicted.step_s < on_gpu.predicted.step_s
    first_fit = _plan(optimizer_offload=False, keep_attention_outputs=False)  # what `auto` used to run
    assert on_gpu.predicted.step_s < first_fit.predicted.step_s
    assert any("optimizer_offload auto: Adam on the host" in n for n in best.notes)
    # the JSON's offload_optimizer section wins over auto
    json_says_gpu = resolve_plan(TrainConfig(model_name_or_path="qwen3-4b", max_length=262144, sp_size=1), Q4,
                                 Machine(gpus=1, **H200), ZeroSettings(optimizer_offload=False))
    assert not json_says_gpu.run.levers.optimizer_offload
    with pytest.raises(ConfigError, match="optimizer_offload true but the ZeRO JSON has no offload_optimizer"):
        resolve_plan(TrainConfig(model_name_or_path="qwen3-4b", max_length=262144, optimizer_offload=True), Q4,
                     Machine(gpus=1, **H200), ZeroSettings(optimizer_offload=False))


def _recipe_plan(recipe: str, *extra: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["plan", "--config", str(ROOT / "launch" / "recipes" / recipe), "--gpu", "h100",
                         "--host_memory_gb", "2000", "--host_cores", "128", *extra, "--json"]) == 0
    return json.loads(out.getvalue())["plan"]


def test_a_sparse_block_takes_fewer_tiles_than_the_rule_where_the_step_is_faster():
    """The tile rule is a memory rule: a sparse block's measured rate falls with its tiles (grouped_mm at 1 and 4
    tiles on the card), so where fewer tiles fit, `auto` times them and takes them when the step is faster; a dense
    MLP, whose time does not depend on its tiles, keeps the rule's count."""
    shape = ModelShape.preset("qwen3.5-35b-a3b")
    rule = default_mlp_tiles(1_048_576 // 8, shape.mlp_row_width)
    auto = _recipe_plan("qwen3_5_35b_a3b_8gpu_1m.yaml")
    at_rule = _recipe_plan("qwen3_5_35b_a3b_8gpu_1m.yaml", "--tiled_mlp", str(rule))
    assert auto["fits"] and auto["tiled_mlp"] < rule and auto["predicted_step_s"] < at_rule["predicted_step_s"]
    dense = ModelShape.preset("qwen3-8b")
    assert _recipe_plan("reference_8gpu_1m.yaml")["tiled_mlp"] == default_mlp_tiles(1_048_576 // 8,
                                                                                    dense.mlp_row_width)


def test_the_ds_config_gets_the_plans_optimizer_placement():
    from ulysses_trainer.ds_config import fill_ds_config
    from ulysses_trainer.vocabulary.names import OFFLOAD_SUB_GROUP_SIZE

    cfg = TrainConfig()
    ds, _ = fill_ds_config(load_ds_config(cfg.deepspeed), cfg, 1, 1, False, bf16=False, optimizer_offload=True)
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["sub_group_size"] == OFFLOAD_SUB_GROUP_SIZE
    ds, _ = fill_ds_config(load_ds_config(cfg.deepspeed), cfg, 1, 1, False, bf16=False, optimizer_offload=False)
    assert "offload_optimizer" not in ds["zero_optimization"]


def test_the_engine_measurement_changes_the_plan_only_when_memory_is_short():
    cfg = TrainConfig(model_name_or_path="qwen3-4b", max_length=262144, sp_size=1)
    first = _plan()
    held = sum(t.gpu for t in first.predicted.estimate.terms if t.phase == "static" and t.name != "Adam m, v") / 2**30
    as_predicted = Machine(gpus=1, **H200, gpu_free_after_engine_gb=139.8 - held - 1.0)
    assert replan_after_engine(first, cfg, Q4, as_predicted) == first
    crowded = replace(as_predicted, gpu_free_after_engine_gb=as_predicted.gpu_free_after_engine_gb - 20)
    second = replan_after_engine(first, cfg, Q4, crowded)
    assert second.predicted.fits and second.predicted.gpu_budget_gb == pytest.approx(119.8, abs=0.01)
    # fixed by the engine
    assert (second.levers.optimizer_offload, second.levers.tiled_mlp) == (first.levers.optimizer_offload,
                                                                        first.levers.tiled_mlp)
    assert len(second.kept_attention_layers) + len(second.saved_layers) - len(second.offload_layers) < \
        len(first.kept_attention_layers) + len(first.saved_layers) - len(first.offload_layers)
    assert any("measured" in n for n in second.notes)
    # nothing but the budget is decided again: not the kernels, even where the machine now lists others
    fused = _plan(norm_kernels=("triton", "torch"))
    assert fused.run.norm_kernel == "triton"
    again = replan_after_engine(fused, cfg, Q4, replace(crowded, norm_kernels=("torch",)))
    assert again.run.norm_kernel == "triton" and again.predicted.gpu_budget_gb == second.predicted.gpu_budget_gb


def test_planning_another_machine_assumes_host_ram_and_says_so(capsys):
    args = ["plan", "--model", "qwen3-8b", "--max_length", "1048576", *YARN, "--gpus", "8", "--gpu_memory_gb", "80"]
    assert cli_main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"]["host_memory_gb"] == 2 * 80 * 8 and "ASSUMED" in out["hardware"]["host_memory_source"]
    assert cli_main(args) == 0
    text = capsys.readouterr().out
    assert "host 1280 GiB per host (ASSUMED: 2 x GPU memory per GPU" in text and "pass --host_memory_gb" in text
    assert "kernels installed there are unknown: auto planned as sdpa" in text
    assert cli_main(args + ["--attn_implementation", "flash_attention_4", "--json"]) == 0  # a kernel there, not here
    assert json.loads(capsys.readouterr().out)["plan"]["attn_implementation"] == "flash_attention_4"


def test_does_not_fit_names_the_limit_and_the_missing_gib(capsys):
    args = ["plan", "--model", "qwen3-32b", "--max_length", "1048576", *YARN, "--gpus", "1", "--gpu_memory_gb", "80",
            "--host_memory_gb", "200"]
    assert cli_main(args) == 1
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert re.match(r"error: does not fit: (GPU|host) memory is short by [\d.]+ GiB \(needs [\d.]+ of [\d.]+ GiB per "
                    r"(GPU|host)\).*; binding limit: ", line), line
    assert "DOES NOT FIT" in out
    assert cli_main(args + ["--json"]) == 1
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert not plan["fits"] and plan["missing_gpu_gb"] + plan["missing_host_gb"] > 0


def test_step_time_rates_are_the_benchmark_files():
    assert kernel_rates_from_results(ROOT / "benchmarks" / "results") == KERNEL_RATES
    assert norm_rates_from_results(ROOT / "benchmarks" / "results") == NORM_S_PER_ELEMENT
    assert rope_rates_from_results(ROOT / "benchmarks" / "results") == ROPE_S_PER_ELEMENT


def test_the_step_swaps_rotate_half_for_the_rope_kernel_where_the_family_takes_it():
    """A Qwen3 step: rotate_half's measured seconds leave the dense term (fitted with them) and the kernel's are
    added, ~10x less; a Qwen3.5 step (HF's RoPE ops) has no RoPE term and its dense term keeps them."""
    from ulysses_trainer.plan.inputs import mlp_run
    from ulysses_trainer.plan.step_time import rope_seconds

    for preset, fused in (("qwen3-4b", True), ("qwen3.5-27b", False)):
        shape = ModelShape.preset(preset)
        s = Settings(max_length=262144, attn_implementation="sdpa", norm_kernel="triton")
        parts = step_time(shape, s, 4_000_000_000).parts
        assert ("RoPE (triton)" in parts) == fused
        if fused:
            run = mlp_run(shape, s)
            half, kernel = (rope_seconds(shape, run, k, shape.layers) for k in ("torch", "triton"))
            assert parts["RoPE (triton)"] == pytest.approx(kernel) and 8 < half / kernel < 12


@pytest.mark.parametrize("source, settings, measured", [
    # benchmarks/results/long_context_ours_fwdbwd_qwen3-4b_262144_kept_cudnn_warm.json (forward+backward)
    ("cudnn kept", dict(max_length=262144, optimizer="none"), 155.90),
    ("fa4 kept", dict(max_length=262144, optimizer="none", attn_implementation="flash_attention_4"), 134.78),
    ("fa4 kept 128K", dict(max_length=131072, optimizer="none", attn_implementation="flash_attention_4"), 39.40),
])
def test_step_time_reproduces_the_calibration_runs(source, settings, measured):
    """The runs the dense rate was fitted to, which rotated q and k with HF's rotate_half: the plan (the fused
    kernel's RoPE) predicts them less rotate_half's measured seconds plus the kernel's. Every run kept all 36
    layers' attention outputs."""
    s = Settings(**settings).with_levers(keep_attention_outputs=36)
    from ulysses_trainer.plan.counts import num_params
    from ulysses_trainer.plan.inputs import mlp_run
    from ulysses_trainer.plan.step_time import rope_seconds

    got = step_time(Q4, s, num_params(Q4), gpu_name="NVIDIA H200")
    half, fused = (rope_seconds(Q4, mlp_run(Q4, s), k, Q4.layers) for k in ("torch", "triton"))
    assert got.total_s == pytest.approx(measured - half + fused, rel=0.03), source
    assert got.extrapolated == ()


def test_a_tiny_step_is_printed_as_a_lower_bound_not_as_zero():
    """The default tiny preset on one GPU: a few milliseconds predicted, not "0.0 s/step", and a note that fixed
    per-step costs are left out; the end-of-run line then compares memory but not the step time."""
    from ulysses_trainer.train.metrics import predicted_vs_measured

    tiny = ModelShape.preset("tiny")
    p = resolve_plan(TrainConfig(model_name_or_path="tiny", max_length=4096, sp_size=1), tiny,
                     Machine(gpus=1, kernels=("sdpa",), norm_kernels=("torch",), **H200), ZeroSettings())
    assert 0 < p.predicted.step_s < MODELLED_FROM_S
    assert f"predicted {format_seconds(p.predicted.step_s)} s/step" in p.summary() and "0.0 s" not in p.summary()
    assert any("not modelled, the prediction is a lower bound" in n for n in p.notes)
    line = predicted_vs_measured(p.predicted.step_s, 0.9, [0.4, 0.1, 0.1], 1.1)
    assert "no comparison under 1 s" in line and "%," not in line.split("peak")[0] and "(+22.2%)" in line
    assert [format_seconds(x) for x in (141.74, 1.0, 0.5, 0.0031)] == ["141.7", "1.0", "0.5", "0.0031"]
    # a real step keeps its signed error
    assert "(-1.0%, median of 1 step(s) after the first, which may include the warm-up" in \
        predicted_vs_measured(157.3, 120.3, [164.6, 155.7], 118.9)
    assert not any("lower bound" in n for n in _plan().notes)


def test_the_measured_step_is_the_steady_one_not_the_warm_up():
    """Qwen3-0.6B at 131,072 tokens on one H200, six steps (benchmarks/results/gpu_tests/steps_0.6b/): the second
    step (18.14 s) is the slowest; the line compares the plan with the steady steps after it, not a mean that the
    warm-up pulls up (15.5 s, +17.5%)."""
    from ulysses_trainer.train.metrics import predicted_vs_measured

    times = [16.00, 18.14, 14.79, 14.79, 14.86, 14.79]
    line = predicted_vs_measured(13.2, 36.5, times, 35.4)
    assert "step 13.2 s vs 14.8 s (+12.0%, median of 5 step(s) after the first)" in line, line
    assert "warm-up" not in line


def test_step_time_says_where_it_extrapolates():
    s = Settings(max_length=1_048_576, layout=Layout(8, 8), attn_implementation="flash_attention_2")
    notes = " ".join(step_time(ModelShape.preset("qwen3-8b"), s, 8_000_000_000).extrapolated)
    assert "held constant at 1,048,576" in notes and "flash_attention_2 not measured" in notes
    assert "communication modelled" in notes and "rates of an H200 assumed" in notes


def test_an_offload_beyond_every_layer_is_refused_when_the_thinning_is_auto():
    # checkpoint_every auto keeps at most every layer's input: more offloaded inputs than layers cannot run
    with pytest.raises(ConfigError, match=r"activation_offload=40 must be between 0 and 36 layers"):
        _plan(activation_offload=40)
    assert len(_plan(activation_offload=36, keep_attention_outputs=0).offload_layers) == 36
