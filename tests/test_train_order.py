"""What a run trains and keeps, without starting a process: the data order (TRL's sampler: the whole dataset each
epoch, whatever max_steps), nothing to train, rows of another shape counted, the logged mean over a logging
interval, save_total_limit's rotation and what overwrite_output_dir removes."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from ulysses_trainer.cli.argv import load_config
from ulysses_trainer.cli.data import describe
from ulysses_trainer.cli.train import main
from ulysses_trainer.data.synthetic import synthetic_document
from ulysses_trainer.train import data_order as order
from ulysses_trainer.train.checkpoint import MARKER, rotate_checkpoints
from ulysses_trainer.train.prepare import prepare
from ulysses_trainer.train.run_log import LogInterval


def _jsonl(path: Path, num_docs: int, words: int, seed: int = 5) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"text": synthetic_document(rng, words, num_pairs=3)}) + "\n"
                            for _ in range(num_docs)))
    return path


def _trained(plan, steps) -> list[tuple[int, ...]]:
    """The sequences (their token ids) that each of `steps` trains, in order."""
    return [tuple(plan.train_data[int(i)]["input_ids"].tolist()) for s in steps for i in order.step_rows(plan, s)]


# ---------------------------------------------------------------- data order
def test_order_covers_the_whole_dataset_each_epoch_whatever_max_steps(tmp_path):
    data = _jsonl(tmp_path / "train.jsonl", num_docs=24, words=60)
    # 3 sequences per step, which the row count does not divide: steps straddle epochs, none is left out
    base = ["--max_length", "128", "--dataset_name", str(data), "--output_dir", str(tmp_path / "out"),
            "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "3"]
    four = prepare(load_config(base + ["--max_steps", "4"]), 1)
    six = prepare(load_config(base + ["--max_steps", "6"]), 1)
    epoch = prepare(load_config(base + ["--max_steps", "null", "--num_train_epochs", "2"]), 1)
    rows = len(epoch.train_data)
    assert rows % 3 != 0 and rows >= 12
    # the whole file is read whatever max_steps (it only says where the run stops)
    assert len(four.train_data) == len(six.train_data) == rows
    # a 4-step run resumed to 6 trains what the straight 6-step run trains: no repeat, no skip
    assert _trained(four, range(4)) + _trained(six, range(4, 6)) == _trained(six, range(6))
    # num_train_epochs 2: every row exactly twice, each epoch one permutation of all rows
    assert epoch.total_steps == math.ceil(2 * rows / 3)
    stream = [int(i) for s in range(epoch.total_steps) for i in order.step_rows(epoch, s)]
    assert sorted(stream[:rows]) == list(range(rows)) and sorted(stream[rows:2 * rows]) == list(range(rows))
    assert stream[:rows] != list(range(rows))  # seeded permutation, not file order
    assert order.epoch_of(epoch, epoch.total_steps) == pytest.approx(epoch.total_steps * 3 / rows)


def test_data_command_shows_the_sequences_in_the_training_order(tmp_path):
    data = _jsonl(tmp_path / "train.jsonl", num_docs=24, words=60)
    args = ["--max_length", "128", "--dataset_name", str(data), "--output_dir", str(tmp_path / "out"),
            "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "3", "--seed", "7"]
    plan = prepare(load_config(args + ["--max_steps", "2"]), 1)
    out, _ = describe(args + ["--json", "--show", "6"])
    trained = [int(i) for s in range(2) for i in order.step_rows(plan, s)]  # steps 1 and 2, in order
    assert [s["row"] for s in out["sequences"]] == trained and trained != sorted(trained)
    for s in out["sequences"]:
        shown = "".join(g["text"] for g in s["segments"])
        assert shown == plan.tokenizer.decode(plan.train_data[s["row"]]["input_ids"].tolist())


# ---------------------------------------------------------------- nothing to train, rows of another shape
def _conversations(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_nothing_to_train_exits_2_before_the_model_naming_the_examples(tmp_path, monkeypatch, capsys):
    no_assistant = [{"messages": [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": f"question {i} " * 8}]} for i in range(3)]
    data = _conversations(tmp_path / "chat.jsonl", no_assistant)
    out = tmp_path / "out"
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    rc = main(["--dataset_name", str(data), "--assistant_only_loss", "true", "--max_length", "64",
               "--max_steps", "3", "--output_dir", str(out)])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1, errors
    assert "has nothing to train on: 3 of 3 examples used have no trained token" in errors[0]
    assert "assistant_only_loss" in errors[0]
    assert not out.exists()


@pytest.mark.parametrize("packing", ["false", "true"])
def test_nothing_to_train_because_max_length_cut_the_assistant_turns_says_so(tmp_path, monkeypatch, capsys, packing):
    long_prompt = [{"messages": [{"role": "user", "content": f"question {i} " * 60},
                                 {"role": "assistant", "content": f"answer {i}"}]} for i in range(3)]
    data = _conversations(tmp_path / "chat.jsonl", long_prompt)
    out = tmp_path / "out"
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    rc = main(["--dataset_name", str(data), "--assistant_only_loss", "true", "--max_length", "64",
               "--packing", packing, "--max_steps", "3", "--output_dir", str(out)])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1, errors
    assert "3 of them had assistant turns that max_length 64 cut off" in errors[0]
    assert "raise max_length" in errors[0] and "add conversations with an assistant turn" not in errors[0]
    assert not out.exists()


def test_rows_of_another_shape_are_counted_by_reason(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"ok {i}"}]}
            for i in range(4)]
    rows.insert(2, {"text": "a text row in a messages file"})
    data = _conversations(tmp_path / "mixed.jsonl", rows)
    args = ["--dataset_name", str(data), "--max_length", "64", "--output_dir", str(tmp_path / "out")]
    plan = prepare(load_config(args + ["--max_steps", "2"]), 1)
    counts = plan.train_data.counts
    reason = "without `messages` (a row of another shape)"
    assert counts.skipped == {reason: 1}
    assert counts.documents_read == 5 and counts.documents_used == 4
    assert f"5 documents read, 4 used, skipped: 1 {reason}" in counts.summary()
    out, _ = describe(args + ["--json"])  # `ulysses-trainer data` shows the same counts
    assert out["counts"]["skipped"] == {reason: 1} and out["counts"]["documents_read"] == 5
    pairs = [{"prompt": f"say {i}", "completion": f" {i} said"} for i in range(3)] + [{"text": "stray"}]
    data = _conversations(tmp_path / "pairs.jsonl", pairs)
    counts = prepare(load_config(["--dataset_name", str(data), "--max_length", "64", "--output_dir",
                                  str(tmp_path / "out2")]), 1).train_data.counts
    assert counts.skipped == {"without `prompt` or `completion` (a row of another shape)": 1}
    assert (counts.documents_read, counts.documents_used) == (4, 3)


# ---------------------------------------------------------------- logged loss
def test_logged_loss_is_the_mean_of_the_step_losses_as_hf_logs_it():
    """transformers' Trainer (and TRL's SFTTrainer, which keeps its `loss`) logs sum(step losses) / steps since the
    last log; the token-weighted mean of the window stays under token_weighted_loss."""
    interval = LogInterval()
    interval.add(2.0, 10, 0.5)
    interval.add(4.0, 30, 1.5)
    assert interval.take(4.0) == (pytest.approx(3.0), pytest.approx((2.0 * 10 + 4.0 * 30) / 40), pytest.approx(1.0))
    interval.add(1.2345678901234567, 7)
    assert interval.take(1.2345678901234567) == (1.2345678901234567, None, None)  # one step: bit for bit
    interval.add(3.0, 5)
    interval.add(float("nan"), 5)  # nan_policy skip: a non-finite step stays out of the mean
    saved = LogInterval.from_state(json.loads(json.dumps(interval.state())))  # across a checkpoint
    assert saved.take(float("nan"))[:2] == (3.0, 3.0)
    interval = LogInterval()
    interval.add(float("inf"), 5)
    assert math.isinf(interval.take(float("inf"))[0])  # nothing finite: the last value shows


# ---------------------------------------------------------------- rotation
def _checkpoint(out: Path, step: int, ours: bool = True) -> Path:
    d = out / f"checkpoint-{step}"
    (d / "ds").mkdir(parents=True)
    if ours:
        (d / MARKER).write_text("")
    return d


def test_rotation_keeps_the_newest_and_latest_and_only_deletes_its_own(tmp_path):
    out = tmp_path / "out"
    for step in (1, 2, 3, 5, 10):
        _checkpoint(out, step)
    _checkpoint(out, 4, ours=False)  # no marker: not the trainer's, never deleted
    (out / "checkpoint-best").mkdir()
    (out / "checkpoint-best" / "keep.txt").write_text("mine")
    (out / "latest").write_text("checkpoint-3\n")  # resumed from 3: later ones of an older run remain
    gone = rotate_checkpoints(str(out), 2)
    assert sorted(Path(p).name for p in gone) == ["checkpoint-1", "checkpoint-2"]
    left = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert left == ["checkpoint-10", "checkpoint-3", "checkpoint-4", "checkpoint-5", "checkpoint-best"]
    (out / "latest").write_text("checkpoint-10\n")
    rotate_checkpoints(str(out), 1)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-10", "checkpoint-4",
                                                                   "checkpoint-best"]
    assert (out / "checkpoint-best" / "keep.txt").read_text() == "mine"
