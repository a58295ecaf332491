"""Trained-token masks through the real command: `deepspeed --num_gpus N launch/train.py` on CPU ranks.

A conversational dataset with tool calls and assistant_only_loss, and a prompt-completion dataset
with completion_only_loss (its default), each trained 2 steps at sp=1 and sp=4 (world = sp):
the logged losses agree within 1e-4 relative, and num_tokens / num_loss_tokens equal what the data
holds. Long tool results make shards that hold no trained token at sp=4 (checked here).
"""

from __future__ import annotations

import json
import random

import pytest

from tests.test_e2e_train import read_metrics, rel, run_train

STEPS, MAX_LENGTH = 2, 384  # step 2's loss is after the first update
COMMON = ["--max_length", str(MAX_LENGTH), "--max_steps", str(STEPS), "--learning_rate", "1e-3", "--bf16", "false",
          "--seed", "5", "--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "1",
          "--save_strategy", "no", "--report_to", "none"]


def agent_conversations(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        listing = " ".join(f"file{rng.randint(0, 99)}.txt" for _ in range(rng.randint(25, 35)))
        out.append({"messages": [
            {"role": "system", "content": "You are a shell agent."},
            {"role": "user", "content": f"Find the largest file, case {i}."},
            {"role": "assistant", "content": "Listing first.", "reasoning_content": "I need the listing.",
             "tool_calls": [{"type": "function", "function": {"name": "ls", "arguments": '{"dir": "."}'}}]},
            {"role": "tool", "content": listing},
            {"role": "assistant", "content": f"The largest is {listing.split()[rng.randrange(10)]} — ok."}],
            "tools": json.dumps([{"type": "function", "function": {"name": "ls", "parameters": {}}}])})
    return out


def prompt_completions(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": "Context: " + " ".join(str(rng.randint(0, 999)) for _ in range(rng.randint(40, 60)))
             + "\nQuestion: the first number?", "completion": f" Answer: {rng.randint(0, 999)}."} for _ in range(n)]


DATASETS = {"conversational": (agent_conversations, ["--assistant_only_loss", "true"]),
            "prompt_completion": (prompt_completions, [])}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("masks")
    for name, (make, _) in DATASETS.items():
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make(8, seed=len(name))))
    return d


def _empty_shards(path, extra) -> tuple[int, int]:
    """(sequences of the dataset with an sp=4 shard that holds no trained token, sequences)."""
    from ulysses_trainer.cli.argv import parse_overrides
    from ulysses_trainer.config.load import build_config
    from ulysses_trainer.data.documents import build_sequences
    from ulysses_trainer.data.qwen_bpe import QwenBPETokenizer
    from ulysses_trainer.parallel.sharding import shard_batch

    _, over = parse_overrides(["--max_length", str(MAX_LENGTH), *extra])
    ds = build_sequences(build_config(None, dict(over, dataset_name=str(path))), QwenBPETokenizer())
    n = 0
    for i in range(len(ds)):
        r = ds[i]
        shards = [shard_batch(r["input_ids"], labels=r["labels"], sp_size=4, sp_rank=k) for k in range(4)]
        n += min(s.num_valid for s in shards) == 0
    return n, len(ds)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(DATASETS))
def test_masked_losses_equal_across_sp(kind, data_dir, tmp_path):
    path, extra = data_dir / f"{kind}.jsonl", DATASETS[kind][1]
    # the case that must not produce NaN or a skipped collective, in every sequence: whichever the steps train
    empty, sequences = _empty_shards(path, extra)
    assert empty == sequences >= 2 * STEPS, (empty, sequences)
    metrics = {}
    for sp_size in (1, 4):  # sp 4 is where every sequence has a rank without a loss token (sp 2 adds time, not cover)
        out = tmp_path / f"sp{sp_size}"
        run_train(sp_size, COMMON + extra + ["--dataset_name", str(path), "--sp_size", str(sp_size)], out)
        metrics[sp_size] = read_metrics(out)[0]
    ref = metrics[1]
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for r in ref:
        assert 0 < r["num_loss_tokens"] < r["num_tokens"] <= r["step"] * 2 * MAX_LENGTH
    for r, a in zip(metrics[4], ref):
        assert rel(r["loss"], a["loss"]) <= 1e-4, (kind, r["step"], r["loss"], a["loss"])
        assert rel(r["grad_norm"], a["grad_norm"]) <= 1e-4, (kind, r["step"], r["grad_norm"], a["grad_norm"])
        assert (r["num_tokens"], r["num_loss_tokens"]) == (a["num_tokens"], a["num_loss_tokens"])
