"""docs/reliability.md's disk rows in one process (one CPU rank, a tiny checkpoint): the up-front space check
counts what the run holds at its peak (save_total_limit, no limit, a resume's checkpoints on disk) and
refuses a run that does not fit; a final export on a full disk (safetensors' writer failing with os error 28)
is one line, exit 1, no final.tmp, and `--resume_from_checkpoint true` then only exports."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.tiny_checkpoint import write_checkpoint, write_documents
from ulysses_trainer.cli.train import main
from ulysses_trainer.train import output_guard
from ulysses_trainer.train.output_guard import DiskNeed, peak_checkpoints, run_need

_GROUP_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize("total, save_steps, limit, start, on_disk, peak", [
    (10, 2, 2, 0, (), 3),  # 2 kept + the one being written
    (10, 2, 1, 0, (), 2),
    (10, 3, None, 0, (), 4),  # every checkpoint: 3, 6, 9 and the last step's 10
    (10, None, None, 0, (), 1),  # the end only
    (10, 20, 5, 0, (), 1),
    (1, 1, 3, 0, (), 1),  # fewer saves than the limit
    (10, 2, None, 4, (2, 4), 5),  # a resume at 4 with 2 and 4 on disk writes 6, 8, 10
    (10, 2, 2, 4, (2, 4), 3),
    (10, 2, 1, 6, (2, 4, 6), 4),  # more on disk than the limit: all of them beside the first new one
    (4, 2, None, 4, (2, 4), 2),  # training already finished: nothing more is written
    (10, 5, None, 5, (5, 10), 3),  # resumed from an earlier checkpoint: checkpoint-10 rewritten beside the old
])
def test_peak_counts_the_kept_checkpoints_and_the_one_being_written(total, save_steps, limit, start, on_disk, peak):
    assert peak_checkpoints(total, save_steps, limit, start, on_disk) == peak


@pytest.mark.parametrize("epochs, limit, held", [(2, None, 2), (3, None, 3), (3, 1, 2), (1, None, 1)])
def test_save_strategy_epoch_counts_a_checkpoint_per_epoch(tmp_path, epochs, limit, held):
    """The synthetic data holds 4 steps an epoch: save_strategy epoch saves at steps 4, 8, ..., as the trainer
    does (train/strategies.save_due), and the disk line says how many the run holds (it said 1 for any)."""
    from ulysses_trainer.cli.argv import load_config
    from ulysses_trainer.train.prepare import prepare

    args = ["--save_strategy", "epoch", "--num_train_epochs", str(epochs), "--max_steps", "null",
            "--max_length", "256", "--output_dir", str(tmp_path / "out")]
    plan = prepare(load_config(args + ([] if limit is None else ["--save_total_limit", str(limit)])), 1)
    assert plan.total_steps == 4 * epochs
    n = f"{held} checkpoint{'s' if held != 1 else ''}"
    assert f"the run holds at most {n} + the export" in plan.disk, plan.disk
    assert peak_checkpoints(12, lambda s: s % 4 == 0, None) == 3


def test_the_need_counts_only_what_is_not_on_disk_yet():
    need = run_need(1000, world_size=2, bf16=True, checkpoints=3, on_disk=1)
    ckpt = 1000 * 12 + 2 * 64 * 1024
    assert need == DiskNeed(3, 1, ckpt, 2000)
    assert need.peak_bytes - need.new_bytes == ckpt
    assert need.held().startswith("at most 3 checkpoints + the export = ")
    assert "1 of them already on disk" in need.held()
    assert run_need(1000, 2, True, 0).held().startswith("logs only")


def _main(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """The command as `python launch/train.py` runs it (a one-rank group it starts itself); its stderr."""
    for var in _GROUP_ENV:  # main() sets them for its group: restored to unset after the test
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.fixture
def tiny(tmp_path) -> list[str]:
    model = write_checkpoint(tmp_path / "model")
    docs = write_documents(tmp_path / "docs.jsonl", num_docs=20, words_per_doc=31)
    return ["--model_name_or_path", str(model), "--dataset_name", str(docs), "--max_length", "32",
            "--bf16", "false", "--output_dir", str(tmp_path / "run")]


def test_a_run_that_does_not_fit_at_its_peak_is_refused(tiny, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    args = tiny + ["--max_steps", "6", "--save_steps", "2", "--save_total_limit", "2"]
    monkeypatch.setattr(output_guard, "free_bytes", lambda path: 2 * 2**20)  # one checkpoint is ~1.2 MB
    rc, text = _main(args, monkeypatch, capsys)
    errors = _errors(text)
    assert rc == 2 and len(errors) == 1, text[-3000:]
    assert f"output_dir {out} has 2.0 MB free" in errors[0]
    assert "the run holds at most 3 checkpoints + the export = " in errors[0] and "at its peak" in errors[0]
    assert "lower save_total_limit" in errors[0]
    assert not out.exists() and "Traceback" not in text


def test_a_full_disk_at_the_export_is_one_line_and_the_resume_only_exports(tiny, tmp_path, monkeypatch, capsys):
    import transformers.modeling_utils as modeling_utils
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    args = tiny + ["--max_steps", "2", "--save_steps", "5"]  # checkpoint-2 is the end of training's save
    real_save = modeling_utils.safe_save_file

    def full_disk(*a, **k):  # what safetensors' Rust writer raises on ENOSPC
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(modeling_utils, "safe_save_file", full_disk)
    rc, text = _main(args, monkeypatch, capsys)
    errors = _errors(text)
    assert rc == 1 and len(errors) == 1, text[-3000:]
    assert errors[0].startswith(f"error: cannot write the final export to {out / 'final'}: No space left on device")
    assert "then resume with --resume_from_checkpoint true" in errors[0]
    assert "Traceback" not in text and "disk: the run holds at most 1 checkpoint + the export" in text
    assert not (out / "final.tmp").exists() and not (out / "final").exists()
    assert (out / "latest").read_text().strip() == "checkpoint-2"
    shards = sorted((out / "checkpoint-2" / "ds").rglob("*.pt"))
    assert shards and all(torch.load(f, map_location="cpu", weights_only=False) for f in shards)
    written = {f: os.stat(f).st_mtime_ns for f in shards}
    rows = (out / "metrics.jsonl").read_text()

    monkeypatch.setattr(modeling_utils, "safe_save_file", real_save)  # space freed
    rc, text = _main(args + ["--resume_from_checkpoint", "true"], monkeypatch, capsys)
    assert rc == 0, text[-3000:]
    assert "training already finished at step 2 (checkpoint-2): writing the final export only" in text
    assert (out / "metrics.jsonl").read_text() == rows  # no step trained, nothing logged
    assert {f: os.stat(f).st_mtime_ns for f in shards} == written  # checkpoint-2 not written again
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"] and not (out / "final.tmp").exists()
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert json.loads((out / "final" / "config.json").read_text())["num_hidden_layers"] == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
