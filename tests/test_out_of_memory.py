"""Out of GPU memory (docs/reliability.md): one line, exit 1, the last checkpoint intact and resumable; and a plan
far over the GPU refused up front (exit 2) unless allow_over_plan.

The test seams (docs/testing.md): `ulysses_trainer.train.out_of_memory.inject` raises torch.OutOfMemoryError at
a chosen step, phase and layer on CPU; `ulysses_trainer.probe.local_gpus` gives the CPU run a GPU's memory.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex

import pytest
import torch
from torch import nn

import ulysses_trainer.train.out_of_memory as oom
from tests.dist_utils import main_captured, run_ranks
from tests.tiny_checkpoint import write_checkpoint, write_documents
from ulysses_trainer.cli.argv import plan_command
from ulysses_trainer.levers.recompute import LayerRecompute
from ulysses_trainer.train.out_of_memory import Where


class _Layer(nn.Module):
    """A decoder layer as HF's checkpoint it: the module hooks outside, forward through the checkpointer."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.lin, self.fn = nn.Linear(4, 4), fn

    def forward(self, x):
        return self.fn(self.lin, x)


@pytest.mark.parametrize("every", [1, 2])
def test_where_names_the_phase_and_the_layer_being_recomputed(monkeypatch, every):
    ckpt = LayerRecompute(3, checkpoint_every=every)
    layers = [_Layer(ckpt.for_layer(i)) for i in range(3)]
    where, seen = Where(), []
    where.watch(layers, ckpt)
    monkeypatch.setattr(oom, "inject", lambda w: seen.append(w.describe()))
    where.enter("forward", step=1)
    x = torch.randn(2, 4, requires_grad=True)
    for layer in layers:
        x = layer(x)
    where.enter("backward")
    x.sum().backward()
    forward = ["forward", "forward, layer 0", "forward, layer 1", "forward, layer 2", "backward"]
    if every == 1:
        backward = [f"{s}, layer {i}" for i in (2, 1, 0) for s in ("checkpoint recompute", "backward")]
    else:  # layer 1 keeps no input: its backward rebuilds it from layer 0's forward first
        backward = ["checkpoint recompute, layer 2", "backward, layer 2", "checkpoint recompute, layer 1",
                    "checkpoint recompute, layer 0", "checkpoint recompute, layer 1", "backward, layer 1",
                    "checkpoint recompute, layer 0",
                    "backward, layer 0"]
    assert seen == forward + backward


def test_plan_command_drops_the_pinned_flags_and_resets_a_recipes():
    argv = ["--config", "r.yaml", "--checkpoint_every", "1", "--tiled_mlp=4", "--max_length", "8192",
            "--local_rank=0"]
    line = plan_command(argv, ("checkpoint_every", "tiled_mlp", "activation_offload"), 2)
    # activation_offload was pinned by the recipe: set back to auto, the others just dropped
    assert line == "ulysses-trainer plan --gpus 2 --config r.yaml --max_length 8192 --activation_offload auto"


def test_plan_command_reads_back_with_a_bare_pinned_boolean(tmp_path):
    """A pinned boolean lever written bare, as the command line allows, takes nothing after it: the suggested
    command keeps --max_length and `plan` reads it back (a second hand-made parser once left a stray `8192`)."""
    from ulysses_trainer.cli.plan import build_plan_inputs

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name_or_path: tiny\nmax_length: 4096\n")
    argv = ["--config", str(recipe), "--gradient_checkpointing", "--max_length", "8192", "--local_rank=0"]
    line = plan_command(argv, ("gradient_checkpointing",), 2)
    assert line == f"ulysses-trainer plan --gpus 2 --config {recipe} --max_length 8192"
    cfg, *_ = build_plan_inputs([*shlex.split(line)[2:], "--gpu_memory_gb", "80"])
    assert cfg.max_length == 8192 and cfg.gradient_checkpointing is True


# ------------------------------------------------------------------ an OOM in a step, 2 CPU ranks


def _train_rank(rank: int, world_size: int, argv: list[str], at: tuple | None) -> tuple[int, str]:
    """The real command's main on this rank, torch.OutOfMemoryError raised at `at` = (step, what) if given."""
    import ulysses_trainer.train.out_of_memory as seam

    if at is not None:
        def inject(where):
            if (where.step, where.describe()) == at:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        seam.inject = inject
    return main_captured(argv)


@pytest.mark.slow
def test_oom_in_a_step_is_one_line_exit_1_and_the_last_checkpoint_resumes(tmp_path):
    model = write_checkpoint(tmp_path / "model")
    docs = write_documents(tmp_path / "docs.jsonl", num_docs=40, words_per_doc=31)
    out = tmp_path / "run"
    argv = ["--model_name_or_path", str(model), "--dataset_name", str(docs), "--max_length", "32", "--bf16",
            "false", "--max_steps", "3", "--save_steps", "1", "--logging_steps", "1", "--checkpoint_every", "1",
            "--output_dir", str(out)]
    (c0, e0), (c1, e1) = run_ranks(2, _train_rank, argv, (2, "checkpoint recompute, layer 0"))
    assert (c0, c1) == (1, 1), e0 + e1
    for rank, err in ((0, e0), (1, e1)):
        errors = [line for line in err.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
        prefix = "" if rank == 0 else r"\(rank 1\) "
        assert re.fullmatch(prefix + r"error: out of memory at step 2 \(checkpoint recompute, layer 0\) on CPU: no "
                            r"device memory to report; the plan predicted [\d.]+ GiB peak allocated \([\d.]+ GiB with "
                            r"allocator slack and CUDA context\) per rank, in host memory here; for a plan that fits "
                            r"run: ulysses-trainer plan --gpus 2 --model_name_or_path .*--max_length 32 .*", errors[0])
        assert "--checkpoint_every" not in errors[0]  # the pinned lever is left to the plan's search
    # step 1's checkpoint is intact and `latest` names it; nothing of step 2 was saved or logged
    assert (out / "latest").read_text().strip() == "checkpoint-1" and not list(out.glob(".tmp-*"))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = [r["loss"] for r in rows if "loss" in r]
    assert [r["step"] for r in rows if "loss" in r] == [1]

    (c0, e0), (c1, e1) = run_ranks(2, _train_rank, argv + ["--resume_from_checkpoint", "true"], None)
    assert (c0, c1) == (0, 0), e0 + e1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3] and [rows[0]["loss"]] == first
    assert (out / "latest").read_text().strip() == "checkpoint-3" and (out / "final").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["building the model", "building the engine"])
def test_oom_while_the_model_or_the_engine_is_built_is_the_same_one_line(tmp_path, phase):
    """Before step 1 (the weights placed on the device, DeepSpeed's ZeRO-3 partitions and optimizer states): the
    same line as in a step, exit 1, no traceback, nothing of the run written."""
    model = write_checkpoint(tmp_path / "model")
    docs = write_documents(tmp_path / "docs.jsonl", num_docs=40, words_per_doc=31)
    out = tmp_path / "run"
    argv = ["--model_name_or_path", str(model), "--dataset_name", str(docs), "--max_length", "32", "--bf16",
            "false", "--max_steps", "2", "--tiled_mlp", "2", "--output_dir", str(out)]
    (c0, e0), (c1, e1) = run_ranks(2, _train_rank, argv, (0, phase))
    assert (c0, c1) == (1, 1), e0 + e1
    for rank, err in ((0, e0), (1, e1)):
        errors = [line for line in err.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
        prefix = "" if rank == 0 else r"\(rank 1\) "
        assert re.fullmatch(prefix + rf"error: out of memory before step 1 \({phase}\) on CPU: no device memory to "
                            r"report; the plan predicted [\d.]+ GiB peak allocated \([\d.]+ GiB with allocator slack "
                            r"and CUDA context\) per rank, in host memory here; for a plan that fits run: "
                            r"ulysses-trainer plan --gpus 2 --model_name_or_path .*--max_length 32 .*", errors[0])
        assert "--tiled_mlp" not in errors[0]  # the pinned lever is left to the plan's search
    assert not (out / "metrics.jsonl").exists() and not list(out.glob("*checkpoint*"))


# ------------------------------------------------------------------ a plan far over the GPU, refused up front

# 36 layers of the tiny model at 65,536 tokens without gradient checkpointing: 8.8 GiB planned on a 4 GiB GPU
# (2.2x); with gradient_checkpointing and activation_offload to the search the plan fits
OVER = ["--max_length", "65536", "--bf16", "false", "--host_memory_gb", "16", "--model_init_kwargs",
        "{num_hidden_layers: 36, rope_parameters: {rope_type: yarn, factor: auto}}",
        "--gradient_checkpointing", "false", "--activation_offload", "0",
        "--max_steps", "1"]


@pytest.fixture
def four_gib_gpu(monkeypatch):
    import ulysses_trainer.probe as probe

    monkeypatch.setattr(probe, "local_gpus", lambda index=0: probe.LocalGpus(1, 4.0, "a stand-in GPU"))


def test_a_plan_far_over_the_gpu_is_refused_before_anything_is_written(tmp_path, four_gib_gpu):
    from ulysses_trainer.cli.train import main

    out = tmp_path / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main([*OVER, "--output_dir", str(out)])
    assert code == 2, err.getvalue()
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        r"error: the plan needs 8\.8 GiB per GPU \([\d.]+ GiB peak allocated, plus allocator slack and CUDA context\) "
        r"but the GPU has 4\.0 GiB: 1\d\d% over, beyond the memory model's worst measured under-prediction \(3\.1%\), "
        r"so the run would stop out of GPU memory; with gradient_checkpointing true, activation_offload auto it fits "
        r"\([\d.]+ GiB\): --gradient_checkpointing true --activation_offload \d+; or set allow_over_plan true to "
        r"start anyway", lines[0]), lines
    assert not out.exists()


@pytest.mark.slow
def test_allow_over_plan_goes_past_the_check_and_says_what_to_expect(tmp_path, four_gib_gpu, capsys):
    from ulysses_trainer.cli.argv import load_config
    from ulysses_trainer.train.prepare import prepare
    from ulysses_trainer.train.run_report import report_plan

    plan = prepare(load_config([*OVER, "--allow_over_plan", "true", "--output_dir", str(tmp_path / "run")]), 1)
    assert not plan.resolved.predicted.fits and plan.resolved.predicted.gpu_required_gb > 2 * 4.0
    report_plan(plan.resolved, before_build=True, digest=plan.plan_digest)
    assert re.search(r"warning: the plan does not fit: GPU memory is short by [\d.]+ GiB .*\(allow_over_plan: over by "
                     r"more than the memory model's worst measured under-prediction \(3\.1%\); the run will most "
                     r"likely stop out of GPU memory\)", capsys.readouterr().out)


def test_the_margin_decides_between_the_warning_and_the_refusal():
    from dataclasses import replace

    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.errors import ConfigError
    from ulysses_trainer.train.prepare import check_gpu_fits

    class Predicted:  # what check_gpu_fits reads of a plan's predictions
        def __init__(self, need: float, fits: bool) -> None:
            self.gpu_budget_gb, self.gpu_required_gb, self.peak_gpu_gb, self.fits = 100.0, need, need - 2, fits

    class Plan:
        def __init__(self, need: float, fits: bool = False) -> None:
            self.predicted = Predicted(need, fits)

    searched = []

    def auto_plan(cfg):
        searched.append(cfg.checkpoint_every)
        return Plan(101.0)

    cfg = TrainConfig(checkpoint_every=1)
    check_gpu_fits(Plan(103.0), cfg, auto_plan)  # 3% over: within the 3.1% margin, the warning only
    assert searched == []
    with pytest.raises(ConfigError, match=r"103\.2 GiB per GPU .* 3% over.*even with checkpoint_every auto it needs "
                                          r"101\.0 GiB: shorten max_length"):
        check_gpu_fits(Plan(103.2), cfg, auto_plan)
    assert searched == ["auto"]  # the pinned lever handed to the search
    check_gpu_fits(Plan(300.0), replace(cfg, allow_over_plan=True), auto_plan)  # the override skips the check
    assert searched == ["auto"]


def test_the_margin_is_the_worst_measured_under_prediction():
    from pathlib import Path

    from ulysses_trainer.plan.calibration import compare, load_calibration, load_measurements
    from ulysses_trainer.plan.memory import UNDER_PREDICTION

    rows = compare(load_calibration() + load_measurements(Path(__file__).parent.parent / "benchmarks" / "results"))
    worst = min(c.gpu_error for c in rows)
    assert worst < 0 and round(-worst, 3) == UNDER_PREDICTION  # a new point under-predicting more must raise it
