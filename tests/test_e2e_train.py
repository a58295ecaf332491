"""End to end through the rank entry of `deepspeed --num_gpus N launch/train.py ...` on CPU ranks.

The ranks are forks of a server that has imported the trainer once (tests/warm_ranks.py: the launcher itself is
tested through the real command elsewhere). Each run still costs seconds on a 2-core machine, so the runs are
few and shared: a module-scoped cache starts each one the first time a test asks for it, and several tests read it.

  sp1   1 rank,  sp 1, accumulation 2 x 1 sequence, eval every 2 steps
  sp2   2 ranks, sp 2, the same (also: log line, metrics keys, checkpoints every 2 steps, export)
  sp4   4 ranks, sp 4, the same
  thin2 2 ranks, sp 2, the same with checkpoint_every 2, the kept checkpoints offloaded and attention
        outputs kept for the recompute
  dp2   2 ranks, sp 1, dp 2: one sequence per rank (the same 2 sequences per step)
  ga1   1 rank,  sp 1, one micro-step of 2 sequences (compared with sp1)
  resume  2 ranks: sp2's output_dir cut back to checkpoint-2, resumed (`true` = latest) to step 4
  unverified  2 ranks: sp2's first step with verify_sp false (sp2 and the others: auto, on at the first start)
  jsonl 1 rank,  a local jsonl file (text in a non-default field) for one epoch, jsonl eval data
"""

from __future__ import annotations

import ast
import json
import math
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.dist_utils import JOB_TIMEOUT_S, job_failure
from tests.warm_ranks import run_trainer

ROOT = Path(__file__).resolve().parent.parent
MAX_STEPS = 4
MAX_LENGTH = 256
LR = 1e-3
CONTRACT_KEYS = {"step", "loss", "grad_norm", "learning_rate", "num_tokens", "epoch", "tokens_per_s",
                 "tflops_per_gpu", "mfu", "peak_gpu_mem_gb", "peak_host_mem_gb", "num_loss_tokens"}
LOG_KEYS = ["loss", "grad_norm", "learning_rate", "num_tokens", "epoch"]
# The sp runs: dp = 1 everywhere, 2 sequences per optimizer step as 2 micro-steps of 1.
COMMON = ["--max_length", str(MAX_LENGTH), "--max_steps", str(MAX_STEPS), "--learning_rate", str(LR),
          "--bf16", "false", "--seed", "3", "--logging_steps", "1"]
# Eval: 4 synthetic sequences (the default makes 2 x batch x dp), in rounds of 2 on dp 1 and dp 2.
SP_ARGS = COMMON + ["--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "1",
                    "--eval_steps", "2", "--per_device_eval_batch_size", "2"]


def run_train(num_gpus: int, args: list[str], output_dir: Path) -> subprocess.CompletedProcess:
    verify = [] if "--verify_sp" in args else ["--verify_sp", "auto"]  # on at the first start, as a user's run
    proc = run_trainer(num_gpus, [*args, *verify, "--output_dir", str(output_dir)], timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, job_failure(proc)
    return proc


def read_metrics(output_dir: Path) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows) of output_dir/metrics.jsonl."""
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]


def log_lines(stdout: str) -> list[dict]:
    """The reference-format dicts printed on stdout (tqdm may share the line)."""
    return [ast.literal_eval(m) for m in re.findall(r"\{'loss': [^{}]*\}", stdout)]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def write_jsonl(path: Path, seed: int, num_docs: int, words: int) -> None:
    """Documents from the project's own generator, in a `body` field next to an unrelated one."""
    from ulysses_trainer.data.synthetic import synthetic_document

    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(num_docs):
            f.write(json.dumps({"id": i, "body": synthetic_document(rng, words, num_pairs=3)}) + "\n")


class Runs:
    """Each named run happens once per module, the first time a test needs it."""

    def __init__(self, root: Path):
        self.root, self.done = root, {}

    def get(self, name: str) -> tuple[Path, subprocess.CompletedProcess]:
        if name not in self.done:
            out = self.root / name
            self.done[name] = (out, getattr(self, "_" + name)(out))
        return self.done[name]

    def _sp1(self, out):
        return run_train(1, SP_ARGS + ["--sp_size", "1"], out)

    def _sp2(self, out):
        return run_train(2, SP_ARGS + ["--sp_size", "2", "--save_steps", "2"], out)

    def _thin2(self, out):  # sp2's run with layer 1's input rebuilt from layer 0's, offloaded, in backward;
        # attention outputs kept from the first forward (the recompute skips the kernel)
        return run_train(2, SP_ARGS + ["--sp_size", "2", "--checkpoint_every", "2", "--activation_offload", "true",
                                       "--keep_attention_outputs", "true", "--save_strategy", "no"], out)

    def _sp4(self, out):
        return run_train(4, SP_ARGS + ["--sp_size", "4"], out)

    def _dp2(self, out):
        return run_train(2, COMMON + ["--sp_size", "1", "--gradient_accumulation_steps", "1",
                                      "--per_device_train_batch_size", "1", "--eval_steps", "2",
                                      "--per_device_eval_batch_size", "1"], out)

    def _ga1(self, out):
        return run_train(1, COMMON + ["--sp_size", "1", "--gradient_accumulation_steps", "1",
                                      "--per_device_train_batch_size", "2"], out)

    def _resume(self, out):
        # What a run killed during step 4's save leaves: checkpoint-2 is the latest, and metrics.jsonl
        # already holds rows for steps 3 and 4, which the resume must drop before writing them again.
        straight, _ = self.get("sp2")
        shutil.copytree(straight, out)
        shutil.rmtree(out / "checkpoint-4")
        shutil.rmtree(out / "final")
        (out / "latest").write_text("checkpoint-2\n")
        return run_train(2, SP_ARGS + ["--sp_size", "2", "--save_steps", "2",
                                       "--resume_from_checkpoint", "true"], out)

    def _unverified(self, out):
        return run_train(2, SP_ARGS + ["--sp_size", "2", "--max_steps", "1", "--save_strategy", "no",
                                       "--verify_sp", "false"], out)

    def _jsonl(self, out):
        data = self.root / "data"
        data.mkdir(exist_ok=True)
        write_jsonl(data / "train.jsonl", seed=11, num_docs=6, words=60)
        write_jsonl(data / "eval.jsonl", seed=12, num_docs=3, words=60)
        args = ["--max_length", str(MAX_LENGTH), "--max_steps", "null", "--num_train_epochs", "1",
                "--bf16", "false", "--dataset_name", str(data / "train.jsonl"),
                "--dataset_text_field", "body",
                "--eval_dataset_name", str(data / "eval.jsonl"), "--eval_steps", "2"]
        return run_train(1, args, out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("e2e"))


# ---------------------------------------------------------------- 2 ranks: logs, metrics, export
@pytest.mark.slow
def test_two_ranks_log_metrics_and_export(runs):
    out, proc = runs.get("sp2")
    train, evals = read_metrics(out)
    assert [r["step"] for r in train] == list(range(1, MAX_STEPS + 1))
    for r in train:
        assert set(r) == CONTRACT_KEYS, set(r) ^ CONTRACT_KEYS
        assert math.isfinite(r["loss"]) and 0 < r["loss"] < 20, r
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, r
        # Accounting counts sequences and optimizer steps, not ranks x shards x micro-steps:
        # 2 sequences of MAX_LENGTH per step, 4 steps per epoch of the synthetic data, linear decay.
        assert r["num_tokens"] == 2 * MAX_LENGTH * r["step"], r
        assert r["num_loss_tokens"] == 2 * (MAX_LENGTH - 1) * r["step"], r  # every token but a row's first
        assert r["epoch"] == pytest.approx(r["step"] / MAX_STEPS), r
        assert r["learning_rate"] == pytest.approx(LR * (1 - r["step"] / MAX_STEPS), abs=1e-12), r
        assert r["tokens_per_s"] > 0 and r["tflops_per_gpu"] > 0 and r["peak_host_mem_gb"] > 0, r
        assert r["peak_gpu_mem_gb"] >= 0 and r["mfu"] is None, r  # a CPU has no dense bf16 peak in the table
    assert train[-1]["loss"] < train[0]["loss"], "the loss did not fall in 4 steps at lr 1e-3"
    assert [r["step"] for r in evals] == [2, 4] and all(math.isfinite(r["eval_loss"]) for r in evals)

    printed = log_lines(proc.stdout)
    assert len(printed) == MAX_STEPS, proc.stdout[-3000:]
    for shown, r in zip(printed, train):
        assert list(shown) == LOG_KEYS
        assert shown["loss"] == round(r["loss"], 4) and shown["grad_norm"] == round(r["grad_norm"], 4)
        assert shown["num_tokens"] == float(r["num_tokens"]) and isinstance(shown["num_tokens"], float)
        assert shown["learning_rate"] == r["learning_rate"] and shown["epoch"] == round(r["epoch"], 4)

    for step in (2, 4):
        assert (out / f"checkpoint-{step}" / "ds").is_dir()
    assert (out / "latest").read_text().strip() == "checkpoint-4"
    final = out / "final"
    assert (final / "config.json").is_file() and list(final.glob("*.safetensors"))
    # the plan's digest, checked equal on both ranks, printed once (rank 0) and recorded in config.json
    digests = re.findall(r"\] plan: .*; digest ([0-9a-f]{16}) on every rank$", proc.stdout, re.M)
    assert len(digests) == 1, proc.stdout[-3000:]
    assert json.loads((out / "config.json").read_text())["plan_digest"] == digests[0]


@pytest.mark.slow
def test_cpu_run_builds_no_shm_op_and_leaves_no_dev_shm_segment(runs):
    # DeepSpeed's CPU shm all-reduce maps 66 MB of /dev/shm per rank and never unlinks it: 300 runs
    # filled 20 GiB of this machine's RAM. ulysses_trainer.parallel.init keeps it out of training.
    _, proc = runs.get("sp2")
    port = proc.args[proc.args.index("--master_port") + 1]
    assert "shm_comm" not in proc.stdout + proc.stderr
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


@pytest.mark.slow
def test_a_run_prints_no_deprecation_warning(runs):
    # torch 2.13 deprecates the collectives DeepSpeed calls; the notice named DeepSpeed's call twice per rank
    _, proc = runs.get("sp2")
    shown = [line for line in (proc.stdout + proc.stderr).splitlines()
             if "FutureWarning" in line or "DeprecationWarning" in line or "is deprecated" in line]
    assert not shown, shown


@pytest.mark.slow
def test_export_reloads_with_transformers_and_matches_checkpoint(runs):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM

    out, _ = runs.get("sp2")
    exported = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).eval()
    # The trained weights, rebuilt independently from the last ZeRO-3 checkpoint (step 4 = the end).
    state = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoint-4"), tag="ds")
    state = {k.removeprefix("causal_lm."): v for k, v in state.items()}
    config = AutoConfig.from_pretrained(out / "final")
    rebuilt = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    missing, unexpected = rebuilt.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set()), missing
    rebuilt.tie_weights()
    rebuilt.eval()

    exported_state = exported.state_dict()
    for name, value in rebuilt.state_dict().items():
        assert exported_state[name].dtype == torch.float32, name
        assert torch.equal(exported_state[name], value), f"{name} differs between final/ and checkpoint-4"
    ids = torch.randint(0, config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = exported(input_ids=ids).logits, rebuilt(input_ids=ids).logits
    assert a.shape == (2, 96, config.vocab_size)
    assert torch.allclose(a, b, rtol=0, atol=1e-6), (a - b).abs().max()

    from transformers import AutoTokenizer  # the tokenizer travels with the export

    tok = AutoTokenizer.from_pretrained(out / "final")
    ids = tok("The code of Velmora is 4821.")["input_ids"]
    assert ids and max(ids) < config.vocab_size and tok.decode(ids) == "The code of Velmora is 4821."


# ---------------------------------------------------------------- sp=1 == sp=2 == sp=4
@pytest.mark.slow
def test_sp1_sp2_sp4_same_losses_grad_norms_and_eval_loss(runs):
    ref_train, ref_eval = read_metrics(runs.get("sp1")[0])
    assert [r["step"] for r in ref_train] == list(range(1, MAX_STEPS + 1))
    for name in ("sp2", "sp4"):
        train, evals = read_metrics(runs.get(name)[0])
        assert [r["step"] for r in train] == [r["step"] for r in ref_train], name
        for r, ref in zip(train, ref_train):
            assert rel(r["loss"], ref["loss"]) <= 1e-5, (name, r["step"], r["loss"], ref["loss"])
            assert rel(r["grad_norm"], ref["grad_norm"]) <= 1e-5, (name, r["step"], r["grad_norm"],
                                                                 ref["grad_norm"])
            for key in ("learning_rate", "num_tokens", "epoch"):
                assert r[key] == ref[key], (name, key, r[key], ref[key])
        assert [r["step"] for r in evals] == [r["step"] for r in ref_eval] == [2, 4], name
        for r, ref in zip(evals, ref_eval):
            assert rel(r["eval_loss"], ref["eval_loss"]) <= 1e-5, (name, r, ref)


@pytest.mark.slow
def test_sp2_sp4_dp2_loss_by_position_equals_sp1_bucket_by_bucket_and_the_plot_is_written(runs):
    """The eval rows' loss by position under ZeRO-3, SP and dp (the sums taken in each rank's chunked loss, then
    all-reduced) equal one process's, bucket by bucket; eval_loss is their total."""
    _, ref_eval = read_metrics(runs.get("sp1")[0])
    for name in ("sp1", "sp2", "sp4", "dp2"):
        out = runs.get(name)[0]
        _, evals = read_metrics(out)
        for r, ref in zip(evals, ref_eval):
            pos, ref_pos = r["eval_loss_by_position"], ref["eval_loss_by_position"]
            # 4 eval rows of 256 tokens, 255 targets each at positions 1..255
            assert pos["edges"] == [0, 128, 256] and pos["tokens"] == ref_pos["tokens"] == [4 * 127, 4 * 128]
            for got, want in zip(pos["loss"], ref_pos["loss"]):
                assert rel(got, want) <= 1e-5, (name, r["step"], pos, ref_pos)
            total = sum(loss * n for loss, n in zip(pos["loss"], pos["tokens"])) / sum(pos["tokens"])
            assert rel(total, r["eval_loss"]) <= 1e-12, (name, total, r["eval_loss"])
        assert (out / "eval_loss_by_position.png").read_bytes()[:4] == b"\x89PNG", name


@pytest.mark.slow
def test_checkpoint_every_2_with_offload_and_kept_attention_trains_as_every_layer(runs):
    ref_train, ref_eval = read_metrics(runs.get("sp2")[0])
    out, proc = runs.get("thin2")
    assert "checkpoints: 1 in 2 layers keeps its input (1/2), 1 in pinned host memory" in proc.stdout
    assert "attention outputs kept for the recompute: 2/2 layers" in proc.stdout
    train, evals = read_metrics(out)
    assert [r["step"] for r in train] == [r["step"] for r in ref_train]
    for r, ref in zip(train, ref_train):  # the same ops recomputed: equal to rounding
        assert rel(r["loss"], ref["loss"]) <= 1e-6 and rel(r["grad_norm"], ref["grad_norm"]) <= 1e-6, (r, ref)
    assert [e["eval_loss"] for e in evals] == pytest.approx([e["eval_loss"] for e in ref_eval], rel=1e-6)


# ---------------------------------------------------------------- accumulation
@pytest.mark.slow
def test_two_accumulation_steps_equal_one_step_of_both_sequences(runs):
    accumulated, _ = read_metrics(runs.get("sp1")[0])  # 2 micro-steps x 1 sequence
    batched, _ = read_metrics(runs.get("ga1")[0])  # 1 micro-step x 2 sequences
    assert [r["step"] for r in batched] == [r["step"] for r in accumulated] == list(range(1, MAX_STEPS + 1))
    for a, b in zip(accumulated, batched):
        # step 1 compares the first update's inputs; steps 2-4 also the weights after each update
        assert rel(a["loss"], b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
        assert rel(a["grad_norm"], b["grad_norm"]) <= 1e-5, (a["step"], a["grad_norm"], b["grad_norm"])
        for key in ("learning_rate", "num_tokens", "epoch"):
            assert a[key] == b[key], (key, a[key], b[key])


@pytest.mark.slow
def test_dp2_equals_one_rank_with_the_same_sequences(runs):
    """dp 2 x 1 sequence == 1 rank x 2 accumulated sequences: loss, gradient norm, eval over dp ranks."""
    ref_train, ref_eval = read_metrics(runs.get("sp1")[0])
    train, evals = read_metrics(runs.get("dp2")[0])
    assert [r["step"] for r in train] == [r["step"] for r in ref_train] == list(range(1, MAX_STEPS + 1))
    for r, ref in zip(train, ref_train):
        assert rel(r["loss"], ref["loss"]) <= 1e-5, (r["step"], r["loss"], ref["loss"])
        assert rel(r["grad_norm"], ref["grad_norm"]) <= 1e-5, (r["step"], r["grad_norm"], ref["grad_norm"])
        for key in ("learning_rate", "num_tokens", "epoch"):
            assert r[key] == ref[key], (key, r[key], ref[key])
    assert [r["step"] for r in evals] == [r["step"] for r in ref_eval] == [2, 4]
    for r, ref in zip(evals, ref_eval):
        assert rel(r["eval_loss"], ref["eval_loss"]) <= 1e-5, (r, ref)


# ---------------------------------------------------------------- exact resume
@pytest.mark.slow
def test_resume_from_step_2_is_bitwise_the_straight_run(runs):
    straight_dir, _ = runs.get("sp2")
    out, proc = runs.get("resume")
    straight, straight_eval = read_metrics(straight_dir)
    resumed, resumed_eval = read_metrics(out)
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout, proc.stdout[-2000:]
    # Rows past the checkpoint were dropped before the new ones: every step once, in order.
    assert [r["step"] for r in resumed] == list(range(1, MAX_STEPS + 1))
    assert [r["step"] for r in resumed_eval] == [2, 4]
    assert len(log_lines(proc.stdout)) == 2, "the resumed run should train (and print) steps 3 and 4 only"
    for a, b in zip(resumed, straight):
        for key in ("loss", "grad_norm", "learning_rate", "num_tokens", "epoch"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])  # bitwise: fp32 on CPU
    assert resumed_eval[-1]["eval_loss"] == straight_eval[-1]["eval_loss"]
    assert (out / "latest").read_text().strip() == "checkpoint-4" and (out / "final").is_dir()


@pytest.mark.slow
def test_verify_sp_checks_sp2_at_the_first_start_and_changes_no_number(runs):
    """sp2 ran the check (auto, first start): its line on rank 0's log; the resumed run did not (auto, resume);
    the first step with the check off is bitwise sp2's."""
    out, proc = runs.get("sp2")
    said = [line for line in proc.stdout.splitlines() if "verify_sp:" in line]
    assert len(said) == 1, proc.stdout[-3000:]
    loss, ref_loss, norm, ref_norm = map(float, re.search(
        r"verify_sp: loss (\S+) vs (\S+), grad norm (\S+) vs (\S+) \(parallelized vs stock, (\d+) tokens",
        said[0]).groups()[:4])
    assert rel(loss, ref_loss) <= 1e-5 and rel(norm, ref_norm) <= 1e-5, said[0]
    assert "verify_sp" not in runs.get("resume")[1].stdout
    unverified_dir, unverified = runs.get("unverified")
    assert "verify_sp" not in unverified.stdout
    first, = read_metrics(unverified_dir)[0]
    ref = read_metrics(out)[0][0]
    assert (first["loss"], first["grad_norm"], first["num_tokens"]) == (ref["loss"], ref["grad_norm"],
                                                                        ref["num_tokens"])  # bitwise: fp32 on CPU


# ---------------------------------------------------------------- a local jsonl dataset
@pytest.mark.slow
def test_local_jsonl_dataset_one_epoch(runs):
    from ulysses_trainer.cli.argv import load_config
    from ulysses_trainer.data.documents import build_sequences
    from ulysses_trainer.data.tokenizer import load_tokenizer

    out, proc = runs.get("jsonl")
    train, evals = read_metrics(out)
    data = runs.root / "data" / "train.jsonl"
    cfg = load_config(["--max_length", str(MAX_LENGTH), "--dataset_name", str(data),
                       "--dataset_text_field", "body"])
    rows = len(build_sequences(cfg, load_tokenizer(None)))
    assert rows >= 2, "the test file should make a few sequences"
    # One epoch of the file, one sequence per step: as many steps as the file has sequences.
    assert [r["step"] for r in train] == list(range(1, rows + 1))
    assert train[-1]["epoch"] == pytest.approx(1.0) and train[-1]["num_tokens"] == rows * MAX_LENGTH
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in train)
    assert [r["step"] for r in evals] == list(range(2, rows + 1, 2))
    assert all(math.isfinite(r["eval_loss"]) for r in evals)
    assert len(log_lines(proc.stdout)) == rows
