"""prepare(): the checks and the accounting fixed before any heavy work (no process group needed)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from ulysses_trainer.cli.argv import load_config
from ulysses_trainer.data.synthetic import synthetic_document
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.train.prepare import prepare


def _jsonl(path: Path, num_docs: int, words: int, seed: int = 5) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"text": synthetic_document(rng, words, num_pairs=3)}) + "\n"
                            for _ in range(num_docs)))
    return path


def test_the_whole_file_is_read_whatever_max_steps(tmp_path):
    data = _jsonl(tmp_path / "train.jsonl", num_docs=24, words=60)
    base = ["--max_length", "128", "--dataset_name", str(data), "--output_dir", str(tmp_path / "out")]
    full = prepare(load_config(base + ["--max_steps", "null"]), 1)
    assert full.steps_per_epoch == full.total_steps == len(full.train_data) >= 8
    capped = prepare(load_config(base + ["--max_steps", "2"]), 1)
    # max_steps only stops the run: the data order is a permutation of the whole file (TRL's sampler)
    assert len(capped.train_data) == len(full.train_data) and capped.total_steps == 2


def test_max_eval_samples_bounds_the_eval_set(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", num_docs=8, words=60)
    evals = _jsonl(tmp_path / "eval.jsonl", num_docs=12, words=60, seed=6)
    args = ["--max_length", "64", "--dataset_name", str(train), "--eval_dataset_name", str(evals),
            "--eval_steps", "1", "--output_dir", str(tmp_path / "out")]
    whole = prepare(load_config(args), 1)
    bounded = prepare(load_config(args + ["--max_eval_samples", "3"]), 1)
    assert len(whole.eval_data) > 3 and len(bounded.eval_data) == 3
    assert bounded.eval_data[2]["input_ids"].tolist() == whole.eval_data[2]["input_ids"].tolist()  # the first 3


def test_eval_data_smaller_than_one_round_is_a_config_error(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", num_docs=8, words=60)
    evals = _jsonl(tmp_path / "eval.jsonl", num_docs=1, words=60, seed=6)  # one sequence of 128
    args = ["--max_length", "128", "--dataset_name", str(train), "--eval_dataset_name", str(evals),
            "--eval_steps", "1", "--output_dir", str(tmp_path / "out")]
    assert len(prepare(load_config(args), 1).eval_data) == 1  # dp 1: one round of 1 works
    with pytest.raises(ConfigError, match="eval round needs 2"):
        prepare(load_config(args + ["--sp_size", "1"]), 2)  # dp 2 would run no round at all
