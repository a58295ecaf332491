"""docs/moe.md's GPU numbers are the committed result files, the step-time tables are rebuilt from them, and the
plan for the committed reduced-depth Qwen3-30B-A3B run (its config.json) is within 10% of its measured step after
the first and 5% of its measured peak."""

import json
import re
from dataclasses import replace
from pathlib import Path

from ulysses_trainer.config import TrainConfig
from ulysses_trainer.ds_config import load_ds_config
from ulysses_trainer.families.qwen3_moe import experts_rate
from ulysses_trainer.model.load import model_config_for
from ulysses_trainer.plan.rates import (
    EXPERTS_TFLOPS,
    LOSS_MATMUL_TFLOPS,
    LOSS_S_PER_LOGIT,
    experts_rates_from_results,
    loss_rates_from_results,
)
from ulysses_trainer.plan.resolve import plan_for
from ulysses_trainer.plan.types import Machine

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MOE = RESULTS / "moe"
PAGE = ROOT / "docs" / "moe.md"
RUN = "moe_reduced_4l_131072"


def _measured() -> tuple[float, float, float]:
    """(mean step s after the first, mean tokens/s after the first, peak GPU GiB after the first)."""
    steps = [json.loads(line) for line in (MOE / f"{RUN}_metrics.jsonl").open()]
    tokens = [b["num_tokens"] - a["num_tokens"] for a, b in zip(steps, steps[1:])]
    later = steps[1:]
    step_s = sum(n / r["tokens_per_s"] for n, r in zip(tokens, later)) / len(later)
    return step_s, sum(r["tokens_per_s"] for r in later) / len(later), max(r["peak_gpu_mem_gb"] for r in later)


def _plan():
    cfg = TrainConfig(**json.loads((MOE / f"{RUN}_config.json").read_text()))
    # at the tiles the run took (auto then took the tile rule's 6; it now times fewer too: tests/test_resolve.py)
    logged = re.search(r"\] plan: .*?tiled_mlp (\d+)", (MOE / f"{RUN}.log").read_text())
    cfg = replace(cfg, tiled_mlp=int(logged.group(1)))
    # the run's machine: one H200, its host (detected 124.8 GiB, the log says), cuDNN and Triton norms installed
    machine = Machine(gpus=1, gpu_memory_gb=139.8, host_memory_gb=124.8, gpu_name="NVIDIA H200", kernels=("sdpa",),
                      norm_kernels=("triton", "torch"))
    return plan_for(cfg, model_config_for(cfg), load_ds_config(cfg.deepspeed), machine)


def test_step_time_tables_are_the_result_files():
    assert experts_rates_from_results(RESULTS) == EXPERTS_TFLOPS
    assert loss_rates_from_results(RESULTS) == (LOSS_MATMUL_TFLOPS, LOSS_S_PER_LOGIT)
    # between measured tile counts the seconds per FLOP are interpolated; beyond 8 held (and said)
    r4, r6, r8 = (experts_rate(EXPERTS_TFLOPS["grouped_mm"], k)[0] for k in (4, 6, 8))
    assert r8 < r6 < r4 and experts_rate(EXPERTS_TFLOPS["grouped_mm"], 16) == (r8, True)


def test_the_reduced_run_is_the_plan_it_logged_and_within_the_targets():
    plan = _plan()
    log = (MOE / f"{RUN}.log").read_text()
    logged = next(line for line in log.splitlines() if "] plan: " in line).split("] plan: ", 1)[1]
    assert plan.summary().split("; predicted")[0] == logged.split("; predicted")[0]  # same levers as the run
    step_s, _, peak = _measured()
    assert abs(step_s / plan.predicted.step_s - 1) <= 0.10, (step_s, plan.predicted.step_s)
    assert abs(peak / plan.predicted.peak_gpu_gb - 1) <= 0.05, (peak, plan.predicted.peak_gpu_gb)


def test_moe_page_numbers_are_the_result_files():
    page = PAGE.read_text()
    section = page[page.index("## Measured on one H200"):page.index("## Rehearsed: the 8-GPU node")]
    rows = json.loads((MOE / "moe_experts_h200.json").read_text())["rows"]
    for r in rows:
        if "active_tflops" not in r:
            continue
        row = (f"| {r['experts_implementation']} | {r['tiles']} | {r['fwd_bwd_s']:.3f} | {r['active_tflops']:.0f} | "
               f"{r['peak_above_start_gb']:.1f} |")
        assert row in section, row
    oom = [r for r in rows if "error" in r]
    assert all(r["error"].startswith("out of memory") for r in oom)
    assert "| batched_mm | " + ", ".join(str(r["tiles"]) for r in oom) + " | out of memory" in section
    step_s, rate, peak = _measured()
    plan = _plan()
    assert f"| step | {step_s:.2f} s ({rate:,.0f} tokens/s) | {plan.predicted.step_s:.2f} s |" in section
    assert f"| peak GPU (allocated) | {peak:.1f} GiB | {plan.predicted.peak_gpu_gb:.1f} GiB |" in section
    assert "python benchmarks/suite.py moe_experts" in section and "python benchmarks/suite.py moe_reduced" in section
    parts = dict(plan.predicted.step_parts)
    attention = parts["attention forward"] + parts["attention backward"]
    assert f"attention is {attention:.2f} s, the sparse blocks\n{parts['experts (grouped_mm)']:.2f} s" in section
    assert f"chunked loss {parts['lm_head and loss']:.2f} s" in section


def test_rehearsals_are_on_the_page_and_meet_the_target():
    """The rank-0 rehearsal of the 8-GPU 1M job ran honestly (local fill, both updates) under 330 s/step; the
    memory-only one at 5.9M stayed under its plan; docs/moe.md states both from the files."""
    page = PAGE.read_text()
    section = page[page.index("## Rehearsed: the 8-GPU node"):page.index("## What the GPU cases are")]
    one = json.loads((RESULTS / "rehearsal" / "rehearse_moe_8gpu_1m.json").read_text())
    assert one["collective_fill"] == "local" and one["compute_time_real"] and not one["standin"]
    assert one["optimizer_update_skipped"] == [False, False]  # both updates ran
    assert one["max_length"] == 1_048_576 and one["world_size"] == 8 and one["predicted_step_s"] <= 330
    assert (f"{one['compute_s']:.2f} s compute + {one['comm_s_estimate']:.2f} s modelled communication = "
            f"**{one['predicted_step_s']:.1f} s/step** ({one['tokens_per_s_predicted']:,.0f} tokens/s) | "
            f"{one['predicted_by_plan_step_s']:.1f} s |") in section
    assert (f"| peak GPU (allocated) | {one['peak_gpu_mem_gb']:.1f} GiB (reserved {one['peak_gpu_reserved_gb']:.1f}) "
            f"| {one['predicted_by_plan_peak_gpu_gb']:.1f} GiB |") in section
    assert abs(one["peak_gpu_mem_gb"] / one["predicted_by_plan_peak_gpu_gb"] - 1) <= 0.05
    far = json.loads((RESULTS / "rehearsal" / "rehearse_moe_longest_4628480.json").read_text())
    assert far["standin"] and far["attention_kernel"] == "standin_memory_only_fa4" and far["status"] == "ok"
    assert far["max_length"] == 4_628_480 and far["peak_gpu_mem_gb"] <= far["predicted_by_plan_peak_gpu_gb"]
    flat = " ".join(section.split())
    peak = f"| peak GPU (allocated) | **{far['peak_gpu_mem_gb']:.1f} GiB** (reserved {far['peak_gpu_reserved_gb']:.1f}:"
    assert peak in flat and f"| {far['predicted_by_plan_peak_gpu_gb']:.1f} GiB |" in flat
    assert f"| host per rank | {far['peak_host_mem_gb']:.1f} GiB" in flat
    heads = json.loads((RESULTS / "rehearsal" / "rehearse_moe_longest_5865472.json").read_text())
    assert f"{heads['peak_gpu_mem_gb']:.1f} GiB against its plan's {heads['predicted_by_plan_peak_gpu_gb']:.1f}" in flat


def test_the_longest_on_the_page_is_the_plans(capsys):
    """4,628,480 tokens is the plan's longest for the recipe with flash-attn-4 on 8 x H200 / 560 GB, as the page
    and the rehearsal's length say."""
    from ulysses_trainer.__main__ import main as cli_main

    assert cli_main(["plan", "--config", "launch/recipes/moe_8gpu_1m.yaml", "--gpu_memory_gb", "139.8",
                     "--host_memory_gb", "560", "--attn_implementation", "flash_attention_4", "--json"]) == 0
    longest = json.loads(capsys.readouterr().out)["largest_max_length"]
    assert longest == 4_628_480 and f"**{longest:,} tokens** with flash-attn-4" in " ".join(PAGE.read_text().split())
