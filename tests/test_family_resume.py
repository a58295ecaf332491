"""A user's Llama (dense, at sp 2) and Mixtral (sparse, at sp 1) checkpoint, each with its own tokenizer and chat
template, trained through the rank entry of `deepspeed launch/train.py` on CPU ranks (tests/warm_ranks.py) on
conversations with assistant_only_loss: a run stopped after step 2 and resumed to step 4 logs what the straight
4-step run logs, bitwise (fp32 on the CPU, the tolerance for a resume), and exports the same final/ bitwise, in the
checkpoint's own layout (its tensor names and shards: Mixtral's experts one by one under block_sparse_moe).

  straight  4 steps, a checkpoint every 2
  resumed   straight's output_dir cut back to checkpoint-2 (what a run killed in step 4's save leaves: metrics.jsonl
            already holds steps 3 and 4), resumed (`true` = latest) to step 4
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from tests.dist_utils import JOB_TIMEOUT_S, job_failure
from tests.family_checkpoints import write_family_checkpoint, write_tokenizer
from tests.test_family_templates import (
    LLAMA31_LIKE,
    LLAMA_SPECIALS,
    MISTRAL_SMALL_MARKED,
    MISTRAL_SPECIALS,
)
from tests.tiny_checkpoint import WORDS
from tests.warm_ranks import run_trainer

pytestmark = pytest.mark.slow
INDEX = "model.safetensors.index.json"
CASES = {"llama-sp2": ("llama", 2, LLAMA_SPECIALS, LLAMA31_LIKE, "<|begin_of_text|>"),
         "mixtral-sp1": ("mixtral", 1, MISTRAL_SPECIALS, MISTRAL_SMALL_MARKED, "<s>")}


def _conversations(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    rows = []
    for _ in range(n):
        msgs = [{"role": "system", "content": words(3)}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            msgs += [{"role": "user", "content": words(rng.randint(2, 8))},
                     {"role": "assistant", "content": words(rng.randint(2, 10))}]
        rows.append(json.dumps({"messages": msgs}))
    path.write_text("\n".join(rows) + "\n")
    return path


def _rows(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _stored(d: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def runs(request, tmp_path_factory):
    model_type, sp, specials, template, bos = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    ckpt = root / "ckpt"
    vocab = write_tokenizer(ckpt, specials, template, bos=bos)
    write_family_checkpoint(ckpt, model_type, vocab_size=vocab)
    data = _conversations(root / "chat.jsonl", 40, seed=5)
    args = ["--model_name_or_path", str(ckpt), "--dataset_name", str(data), "--assistant_only_loss", "true",
            "--max_length", "64", "--packing", "true", "--max_steps", "4", "--save_steps", "2", "--sp_size", str(sp),
            "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3",
            "--lr_scheduler_type", "cosine", "--warmup_steps", "1", "--bf16", "false", "--seed", "3",
            "--logging_steps", "1", "--verify_sp", "false"]

    def train(out: Path, *extra: str):
        proc = run_trainer(sp, [*args, *extra, "--output_dir", str(out)], timeout=JOB_TIMEOUT_S)
        assert proc.returncode == 0, job_failure(proc)
        return proc

    straight, resumed = root / "straight", root / "resumed"
    train(straight)
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoint-4")
    shutil.rmtree(resumed / "final")
    (resumed / "latest").write_text("checkpoint-2\n")
    proc = train(resumed, "--resume_from_checkpoint", "true")
    return ckpt, straight, resumed, proc


def test_the_resumed_run_logs_the_straight_runs_steps_bitwise(runs):
    _, straight, resumed, proc = runs
    a, b = _rows(straight), _rows(resumed)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    assert "at step 2" in proc.stdout, proc.stdout[-2000:]
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "learning_rate", "num_tokens", "num_loss_tokens"):
            assert json.dumps(x[key]) == json.dumps(y[key]), (key, x, y)
    assert a[0]["loss"] != a[-1]["loss"]  # it trained


def test_the_resumed_export_is_the_straight_runs_in_the_checkpoints_layout(runs):
    import torch

    ckpt, straight, resumed, _ = runs
    got, want, source = _stored(resumed / "final"), _stored(straight / "final"), _stored(ckpt)
    assert set(got) == set(want) == set(source)
    assert all(torch.equal(got[k], want[k]) for k in got)
    assert not all(torch.equal(got[k].float(), source[k].float()) for k in got)  # trained
    index = json.loads((resumed / "final" / INDEX).read_text())["weight_map"]
    assert index == json.loads((ckpt / INDEX).read_text())["weight_map"]
    assert (resumed / "final" / "chat_template.jinja").read_text() == (ckpt / "chat_template.jinja").read_text()
