"""The plan from the data: packed rows cost their documents' sum(l_i^2) of attention, not max_length^2; memory
stays that of a dense row; without data (or without packing) the plan times one document and says so."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ulysses_trainer.__main__ import main as cli_main
from ulysses_trainer.config import TrainConfig
from ulysses_trainer.data.sequences import SequenceDataset
from ulysses_trainer.plan.attention_share import AttentionShare, row_fractions, segment_lengths
from ulysses_trainer.plan.inputs import ModelShape, Settings
from ulysses_trainer.plan.memory import estimate
from ulysses_trainer.plan.resolve import WORST_CASE, resolve_plan
from ulysses_trainer.plan.step_time import step_time
from ulysses_trainer.plan.types import Machine, ZeroSettings
from ulysses_trainer.vocabulary.layout import Layout

ROOT = Path(__file__).resolve().parent.parent
Q4 = ModelShape.preset("qwen3-4b")
H200 = dict(gpu_memory_gb=139.8, host_memory_gb=1000.0, gpu_name="NVIDIA H200")


def test_segments_and_fractions_by_hand():
    pos = np.array([0, 1, 2, 0, 1, 2, 3, 4] + [0] * 8, np.int32)  # row 0: documents 3 + 5; row 1: 8 one-token
    assert segment_lengths(pos[:8]).tolist() == [3, 5]
    ds = SequenceDataset(np.zeros(16, np.int32), pos, 8, "t", 10, None)
    assert row_fractions(ds).tolist() == [(9 + 25) / 64, 8 / 64]
    unpacked = SequenceDataset(np.zeros(24, np.int32), None, 8, "t", 3, None)
    assert row_fractions(unpacked).tolist() == [1.0, 1.0, 1.0]  # no packing: one span per row
    share = AttentionShare.of(ds)
    assert (share.rows, share.low, share.high) == (2, 8 / 64, 34 / 64) and share.mean == pytest.approx(21 / 64)
    # the rows a run trains, in order, repeats counted: row 0 twice and row 1 once
    assert AttentionShare.of(ds, np.array([0, 1, 0])).mean == pytest.approx((34 + 8 + 34) / 3 / 64)


def test_pads_count_no_attention():
    """A row's pads are segments the kernels leave out (parallel/sharding.py): only its real documents count,
    whatever positions the pads carry (they continue the last document's)."""
    pos = np.array([0, 1, 2, 0, 1, 2, 3, 4], np.int32)  # documents 3 + 2, then 3 pads continuing the second
    ds = SequenceDataset(np.zeros(8, np.int32), pos, 8, "t", 2, None, lengths=np.array([5]))
    assert row_fractions(ds).tolist() == [(9 + 4) / 64]
    one = SequenceDataset(np.zeros(8, np.int32), None, 8, "t", 1, None, lengths=np.array([6]))
    assert row_fractions(one).tolist() == [36 / 64]  # one conversation and its pads


def test_attention_time_scales_with_the_fraction_and_memory_does_not_move():
    s = Settings(max_length=262144, attn_implementation="flash_attention_4").with_levers(gradient_checkpointing=True)
    packed = replace(s, attention_fraction=0.3)
    n = 4_000_000_000
    full, part = step_time(Q4, s, n).parts, step_time(Q4, packed, n).parts
    for k in ("attention forward", "attention backward"):
        assert part[k] == pytest.approx(0.3 * full[k], rel=1e-12) and full[k] > 0
    assert {k: v for k, v in part.items() if "attention" not in k} == \
        {k: v for k, v in full.items() if "attention" not in k}
    assert estimate(Q4, packed).gpu_peak == estimate(Q4, s).gpu_peak  # a packed row: a dense row's tensors
    assert estimate(Q4, packed).host_per_host == estimate(Q4, s).host_per_host


def _plan(attention=None, **cfg):
    base = dict(model_name_or_path="qwen3-4b", max_length=262144, sp_size=1, packing=True,
                keep_attention_outputs=False, activation_offload=True, tiled_mlp=8, checkpoint_every=1,
                optimizer_offload=False)
    machine = Machine(gpus=1, kernels=("flash_attention_4",), norm_kernels=("torch",), **H200)
    return resolve_plan(TrainConfig(**(base | cfg)), Q4, machine, ZeroSettings(), attention=attention)


def test_the_plan_line_says_the_packed_attention_fraction():
    worst, packed = _plan(), _plan(AttentionShare(0.25, 0.1, 0.4, 8))
    assert worst.attention_from == "one document (worst case)" and worst.run.attention_fraction == 1.0
    assert WORST_CASE in worst.notes and "worst case" in worst.summary()
    assert packed.attention_from == "data" and packed.run.attention_fraction == 0.25
    assert "packed attention 25.0% of one document" in packed.summary()
    assert any("25.0% of one document of max_length" in n and "8 sequences" in n for n in packed.notes)
    wp, pp = dict(worst.predicted.step_parts), dict(packed.predicted.step_parts)
    assert pp["attention backward"] == pytest.approx(0.25 * wp["attention backward"])
    assert packed.predicted.step_s < worst.predicted.step_s
    assert packed.predicted.peak_gpu_gb == worst.predicted.peak_gpu_gb  # memory: as a dense row
    dense = _plan(packing=False)  # no packing: one span per row, nothing to say
    assert dense.attention_from == "" and dense.run.attention_fraction == 1.0 and "packed" not in dense.summary()
    assert _plan(AttentionShare(0.25, 0.1, 0.4, 8), packing=False).run.attention_fraction == 1.0


def test_plan_command_takes_the_attention_from_the_data(capsys):
    from ulysses_trainer.cli.argv import load_config
    from ulysses_trainer.data.documents import build_sequences
    from ulysses_trainer.data.order import trained_rows
    from ulysses_trainer.data.qwen_bpe import QwenBPETokenizer

    recipe = str(ROOT / "launch" / "recipes" / "one_gpu_4b_sessions.yaml")
    args = ["plan", "--config", recipe, "--gpus", "1", "--gpu_memory_gb", "139.8", "--host_memory_gb", "1000",
            "--max_steps", "2", "--json"]
    assert cli_main(args) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    cfg = load_config(["--config", recipe, "--max_steps", "2"])
    data = build_sequences(cfg, QwenBPETokenizer())  # all of it, as the trainer reads it: then its first 2 rows
    want = AttentionShare.of(data, trained_rows(cfg.seed, len(data), 1, 2))
    assert plan["attention_from"] == "data" and plan["attention_fraction"] == pytest.approx(want.mean)
    assert 0 < plan["attention_fraction"] < 1
    assert cli_main(args[:-1] + ["--dataset_name", "null", "--json"]) == 0  # no data: the worst case, said
    worst = json.loads(capsys.readouterr().out)["plan"]
    assert worst["attention_fraction"] == 1.0 and worst["attention_from"] == "one document (worst case)"
    assert WORST_CASE in worst["notes"]
    assert plan["predicted_step_s"] < worst["predicted_step_s"]


def test_the_replan_after_the_engine_keeps_the_datas_attention(monkeypatch, capsys):
    """The trainer plans again once the engine holds its memory: packed rows stay timed from their documents."""
    from types import SimpleNamespace

    import torch

    from ulysses_trainer.train import build

    pos = np.array([0, 1, 2, 0, 1, 2, 3, 4] * 2, np.int32)  # two rows of documents 3 + 5 (of 8)
    data = SequenceDataset(np.zeros(16, np.int32), pos, 8, "t", 10, None)
    share = AttentionShare.of(data)
    first = _plan(share, dataset_name="some.jsonl")
    cfg = TrainConfig(model_name_or_path="qwen3-4b", max_length=262144, sp_size=1, packing=True,
                      dataset_name="some.jsonl", keep_attention_outputs=False, activation_offload=True, tiled_mlp=8,
                      checkpoint_every=1, optimizer_offload=False)
    machine = Machine(gpus=1, kernels=("flash_attention_4",), norm_kernels=("torch",), **H200)
    plan = SimpleNamespace(device="cuda", machine=machine, shape=Q4, zero=ZeroSettings(), resolved=first,
                           train_data=data, layout=None, attention=share)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (120 * 2**30, 140 * 2**30))
    monkeypatch.setattr(build, "agree_free_memory", lambda gb: gb)
    run = SimpleNamespace(cfg=cfg, **vars(plan))
    again = build.resolve_after_engine(run, build.measured_machine(run, "cuda"))
    assert again.attention_from == "data" and again.run.attention_fraction == pytest.approx(share.mean)
    assert again.run.attention_fraction == pytest.approx(34 / 64)
    assert again.predicted.step_s < _plan(None, dataset_name="some.jsonl").predicted.step_s
    # the after-engine phase says itself in one line, with the budget it measured (train/run_report.replan_line)
    from ulysses_trainer.train.run_report import replan_line

    line = replan_line(first, again, 120.0)  # this config fixes every lever: the measured memory changes none
    assert line == "replanned after the engine (120.0 GiB GPU memory free on the fullest rank): unchanged", line
    fewer = replace(again, run=again.run.with_levers(activation_offload=3, tiled_mlp=16))  # as a fuller GPU would
    assert replan_line(again, fewer, 20.5).endswith(": changed activation_offload 36 -> 3, tiled_mlp 8 -> 16"), \
        replan_line(again, fewer, 20.5)
    assert replan_line(again, again, 120.0).endswith(": unchanged")
    # what the trainer logs (train/run_report.report_replan): the line whether or not it changed, the plan again
    # only when it did, nothing on a CPU run (no measurement, no second search)
    from ulysses_trainer.train.run_report import report_replan

    def said() -> list[str]:  # the console's lines (tests/conftest.py installs it, as the commands do)
        return [x.removeprefix("[ulysses_trainer] ") for x in capsys.readouterr().out.splitlines()]

    said()
    report_replan(first, again, 120.0, "d1")
    assert said() == [line]
    report_replan(again, fewer, 20.5, "d2")
    lines = said()
    assert lines[0] == replan_line(again, fewer, 20.5)
    assert lines[1].startswith("plan with the free GPU memory measured: ") and lines[1].endswith("d2 on every rank")
    report_replan(first, first, None, "d1")
    assert said() == []


def test_a_hybrids_full_layers_are_block_tops_under_checkpoint_every_2():
    """Qwen3.5-27B attends in layers 3, 7, ..., 63: under checkpoint_every 2 each is its block's top, never
    rebuilt, so its attention runs forward twice as under checkpoint_every 1 (not the layers' average 2.5), while
    the DeltaNet layers 0 and 2 of every 4 run a third forward. checkpoint_every 3 rebuilds some full layers."""
    shape = ModelShape.preset("qwen3.5-27b")
    base = Settings(max_length=1048576, layout=Layout(8, 8), attn_implementation="sdpa", deltanet_kernel="fla")

    def parts(every: int) -> dict[str, float]:
        s = base.with_levers(gradient_checkpointing=True, checkpoint_every=every, keep_attention_outputs=0)
        return step_time(shape, s, shape.num_params, gpu_name="NVIDIA H100 80GB HBM3").parts

    one, two, three = parts(1), parts(2), parts(3)
    assert two["attention forward"] == pytest.approx(one["attention forward"], rel=1e-12)
    assert two["attention backward"] == pytest.approx(one["attention backward"], rel=1e-12)
    assert three["attention forward"] == pytest.approx(one["attention forward"] * 42 / 32)  # 10 of 16 rebuilt
    mixer = next(k for k in one if k.startswith("linear_attention"))
    assert two[mixer] > one[mixer]  # 32 of the 48 DeltaNet layers are rebuilt
