"""docs/reliability.md's run-time rows through the real commands on CPU (2 ranks): a read-only and a full
output_dir (a tmpfs mounted for the test, with room for few files), resuming the last good checkpoint to the
same losses, a changed config on resume, and Ctrl-C through `ulysses-trainer train` (during training and
before it)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import JOB_TIMEOUT_S, free_port, start_job, train_command, train_env
from tests.held_rank import has_pending, held_env, is_stopped, wait_for
from tests.tiny_checkpoint import write_checkpoint, write_documents
from ulysses_trainer.cli.launcher import catches_sigterm

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str], ranks: int) -> subprocess.CompletedProcess:
    cmd = train_command(2, args) if ranks == 2 else [sys.executable, "launch/train.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=train_env(), capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S)


def _lines(proc, pattern: str) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if re.search(pattern, line)]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# the run below holds 19 inodes once checkpoint-1 is written (the mount's root, output_dir, config.json,
# metrics.jsonl, the TensorBoard events, latest, checkpoint-1's 12): 2 more let .tmp-checkpoint-2/ds/ be made,
# not its shards. The bytes are plenty, so the up-front space check passes and the disk fills during the run.
_INODES = 21


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=8m,nr_inodes={_INODES}", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _remount(mnt: Path, opts: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{opts}", str(mnt)], check=True)


def test_read_only_and_full_output_dir_then_resume_the_last_good_checkpoint(tmp_path, small_fs):
    model = write_checkpoint(tmp_path / "model")
    docs = write_documents(tmp_path / "docs.jsonl", num_docs=40, words_per_doc=31)
    out = small_fs / "run"
    common = ["--model_name_or_path", str(model), "--dataset_name", str(docs), "--max_length", "32",
              "--bf16", "false", "--max_steps", "2", "--save_steps", "1", "--output_dir", str(out)]

    _remount(small_fs, "ro")  # read-only: refused before the model is built
    ro = _run(common, 1)
    assert ro.returncode == 2, ro.stderr[-3000:]
    errors = _lines(ro, r"^error:")
    assert len(errors) == 1 and re.search(r"output_dir .*run is not writable \(.*mnt: Read-only file system\)",
                                          errors[0])
    assert not _lines(ro, "Loading weights|plan:") and "Traceback" not in ro.stderr
    _remount(small_fs, "rw")

    # checkpoint-1 fits, checkpoint-2 does not (no inode left for its shards)
    full = _run(common, 2)
    assert full.returncode == 1, full.stderr[-3000:]
    errors = _lines(full, r"^error:")
    assert len(errors) == 1, full.stderr[-3000:]
    assert re.search(r"cannot write checkpoint-2 to .*run/\.tmp-checkpoint-2: No space left on device", errors[0])
    assert "Traceback" not in full.stderr and not _lines(full, "Connection closed")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith((".tmp", "checkpoint"))) == ["checkpoint-1"]
    assert (out / "latest").read_text().strip() == "checkpoint-1"
    logged = {r["step"]: r["loss"] for r in _rows(out) if "loss" in r}
    assert sorted(logged) == [1, 2]

    # a resume that changes the results is refused, naming both values; nothing is touched
    before = (out / "metrics.jsonl").read_bytes()
    changed = _run(common + ["--resume_from_checkpoint", "true", "--max_length", "64"], 1)
    assert changed.returncode == 2, changed.stderr[-3000:]
    errors = _lines(changed, r"^error:")
    assert len(errors) == 1 and "max_length: 32 in the checkpoint, 64 now" in errors[0]
    assert "allow_config_change true" in errors[0] and (out / "metrics.jsonl").read_bytes() == before

    _remount(small_fs, "nr_inodes=1000")  # space freed: the last good checkpoint resumes to the same losses
    resumed = _run(common + ["--resume_from_checkpoint", "true"], 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = {r["step"]: r["loss"] for r in _rows(out) if "loss" in r}
    assert again == logged  # bitwise: step 2 retrained from checkpoint-1
    assert (out / "latest").read_text().strip() == "checkpoint-2" and (out / "final").is_dir()
    record = json.loads((out / "config.json").read_text())
    assert record["layout"] == {"world_size": 2, "sp_size": 2, "dp_size": 1}
    # the whole file is read (the data order is a permutation of all of it, whatever max_steps)
    assert record["data"]["train"]["sequences"] == 40 and len(record["history"]) == 1
    assert _lines(resumed, r"\[ulysses_trainer\] data: .*docs\.jsonl: 40 documents read, 40 used, skipped: none")


def _ulysses_train(args: list[str], env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    """`ulysses-trainer train` in its own process group, as a terminal runs it (Ctrl-C = SIGINT to the group);
    its output to `log` if given (a held rank must not wait on a full pipe), else a pipe."""
    cmd = [sys.executable, "-m", "ulysses_trainer", "train", "--num_gpus", "2", "--master_port", str(free_port()),
           *args]
    return start_job(cmd, open(log, "w") if log else subprocess.PIPE, env or train_env(), text=True)




def _finish(job: subprocess.Popen, log: Path) -> str:
    try:
        job.wait(timeout=JOB_TIMEOUT_S)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return log.read_text()


def _ranks_left(marker: str, local_rank: int | None = None) -> list[int]:
    """The rank processes (of one local rank, if given) whose command line holds `marker`."""
    out = []
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmd.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        rank = next((a.split("=", 1)[1] for a in args if a.startswith("--local_rank=")), None)
        if rank is not None and any(marker in a for a in args) and local_rank in (None, int(rank or 0)):
            out.append(int(cmd.parent.name))
    return out


def _held_rank0(job: subprocess.Popen, out: Path) -> int:
    """Rank 0's pid once it has stopped itself where held_env said (an event, whatever the machine's load)."""
    wait_for(lambda: any(map(is_stopped, _ranks_left(str(out), 0))), job, "rank 0 held")
    return _ranks_left(str(out), 0)[0]


def _press_and_wait_for_the_ranks(job: subprocess.Popen, rank0: int) -> None:
    """Ctrl-C, and until the command has passed it on to rank 0 (held: the SIGINT is pending there)."""
    os.killpg(job.pid, signal.SIGINT)
    wait_for(lambda: has_pending(rank0, signal.SIGINT), job, "the Ctrl-C passed on to rank 0")


def _tiny_run(tmp_path: Path, *options: str) -> tuple[Path, list[str]]:
    """The output dir and the arguments of a 32-token run of a tiny checkpoint on 80 documents, plus `options`."""
    model = write_checkpoint(tmp_path / "model")
    docs = write_documents(tmp_path / "docs.jsonl", num_docs=80, words_per_doc=31)
    out = tmp_path / "run"
    return out, ["--model_name_or_path", str(model), "--dataset_name", str(docs), "--max_length", "32",
                 "--bf16", "false", *options, "--output_dir", str(out)]


def test_ctrl_c_saves_and_waits_and_a_run_interrupted_before_training_leaves_nothing(tmp_path):
    out, common = _tiny_run(tmp_path, "--lr_scheduler_type", "constant")

    early = _ulysses_train(common + ["--max_steps", "40"])
    # the ranks have their handlers (importing torch): nothing written yet
    wait_for(lambda: len(_ranks_left(str(out))) == 2 and all(map(catches_sigterm, _ranks_left(str(out)))), early,
             "the ranks' handlers")
    os.killpg(early.pid, signal.SIGINT)
    text = early.communicate(timeout=JOB_TIMEOUT_S)[0]
    assert early.returncode == 130, text[-3000:]
    assert len(re.findall(r"interrupted before training: nothing written", text)) == 1, text[-3000:]
    assert "Traceback" not in text and not out.exists() and not _ranks_left(str(out))

    # Ctrl-C while step 1's row is written: rank 0 holds itself there until the Ctrl-C has reached it
    log = tmp_path / "job.log"
    job = _ulysses_train(common + ["--max_steps", "40"], held_env(tmp_path, "metrics.jsonl"), log)
    rank0 = _held_rank0(job, out)
    _press_and_wait_for_the_ranks(job, rank0)
    os.kill(rank0, signal.SIGCONT)
    text = _finish(job, log)
    assert job.returncode == 130, text[-3000:]  # saved and stopped: a Ctrl-C's status
    assert not _ranks_left(str(out))  # the command returned after the ranks had finished
    assert text.count("interrupted: saving at the next step boundary") == 1 and "Traceback" not in text, text[-3000:]
    step = 1  # the boundary after that row: the ranks agree on the stop there
    assert text.count(f"stop signal: saved step {step}, exiting") == 1, text[-3000:]
    assert (out / "latest").read_text().strip() == f"checkpoint-{step}" and not list(out.glob(".tmp-*"))

    # a harmless change on resume goes through and is recorded where it took effect
    resumed = _run(common + ["--max_steps", str(step + 1), "--resume_from_checkpoint", "true",
                             "--learning_rate", "5e-5"], 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = _rows(out)
    assert all("loss" in r or "eval_loss" in r for r in rows)  # metrics.jsonl: training (and eval) rows only
    change = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert change == [{"step": step, "config_change": {"learning_rate": [1e-4, 5e-5],
                                                       "max_steps": [40, step + 1]}}]
    assert [r["learning_rate"] for r in rows if r.get("step") == step + 1 and "loss" in r] == [5e-5]
    history = json.loads((out / "config.json").read_text())["history"]
    assert len(history) == 1 and history[0]["until_step"] == step
    assert history[0]["config"]["learning_rate"] == 1e-4


def test_a_second_ctrl_c_stops_at_once_and_the_last_checkpoint_resumes(tmp_path):
    out, common = _tiny_run(tmp_path, "--save_steps", "1")
    # rank 0 holds itself in the save of step 3 (checkpoint-2 exists), before it renames it into place; the first
    # Ctrl-C reaches the ranks there, so the second finds the save unfinished
    log = tmp_path / "job.log"
    job = _ulysses_train(common + ["--max_steps", "40"], held_env(tmp_path, ".tmp-checkpoint-3/latest"), log)
    _press_and_wait_for_the_ranks(job, _held_rank0(job, out))
    assert (out / ".tmp-checkpoint-3").is_dir()
    os.killpg(job.pid, signal.SIGINT)
    text = _finish(job, log)
    assert job.returncode == 130, text[-3000:]
    assert len(re.findall(r"stopped at once \(second Ctrl-C\)", text)) == 1 and "Traceback" not in text
    assert not _ranks_left(str(out)) and not list(out.glob(".tmp-*"))
    last = (out / "latest").read_text().strip()
    assert last == "checkpoint-2" and (out / last / "ds").is_dir()
    resumed = _run(common + ["--max_steps", str(int(last.split("-")[1]) + 1), "--resume_from_checkpoint", "true"],
                   2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / last}" in resumed.stdout + resumed.stderr


@pytest.mark.parametrize("moment", ["command", "ranks_exist", "ranks_ready"])
def test_ctrl_c_at_any_moment_of_startup_says_one_line(tmp_path, moment):
    """Ctrl-C at a known point of start-up, each reached by an event rather than a delay: once the command can
    take it (its handler is in place: /proc SigCgt), as soon as the rank processes exist (their interpreters
    start: the command holds the request until they can take it), and once the ranks have their handlers
    (torch, transformers and DeepSpeed import, inputs are checked). Each: one line, exit 130, no output_dir, no
    traceback (a KeyboardInterrupt inside a library's import used to surface as that library's error or abort
    the process; the runner killed by the Ctrl-C in the instant between fork and setsid came back as 254)."""
    out, common = _tiny_run(tmp_path)
    job = _ulysses_train(common + ["--max_steps", "40"])
    if moment == "command":
        wait_for(lambda: catches_sigterm(job.pid), job, "the command's handler")
    elif moment == "ranks_exist":
        wait_for(lambda: _ranks_left(str(out)), job, "the ranks")
    else:
        wait_for(lambda: len(_ranks_left(str(out))) == 2 and all(map(catches_sigterm, _ranks_left(str(out)))), job,
                  "the ranks' handlers")
    os.killpg(job.pid, signal.SIGINT)
    text = job.communicate(timeout=JOB_TIMEOUT_S)[0]
    assert job.returncode == 130, text[-3000:]
    assert len(re.findall(r"interrupted before training: nothing written", text)) == 1, text[-3000:]
    assert "Traceback" not in text and "Error" not in text.replace("[ERROR]", ""), text[-3000:]
    assert not out.exists() and not _ranks_left(str(out))


def test_the_runner_killed_by_the_ctrl_c_is_reported_as_an_interruption(tmp_path):
    """The deepspeed runner shares the command's process group for an instant (between fork and setsid), so a
    Ctrl-C then kills it before any rank exists. A `deepspeed` that dies of SIGINT at once stands in for it (it
    is found first on PATH): one line, exit 130, never the runner's -2 passed on as exit 254."""
    fake = tmp_path / "bin" / "deepspeed"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nkill -INT $PPID\nkill -INT $$\nsleep 5\n")
    fake.chmod(0o755)
    env = dict(train_env(), PATH=f"{fake.parent}:{os.environ['PATH']}")
    proc = subprocess.run([sys.executable, "-m", "ulysses_trainer", "train", "--num_gpus", "2"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert proc.stderr.count("interrupted before training: nothing written") == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_the_commands_import_no_torch_before_they_handle_ctrl_c():
    """`ulysses-trainer`, its launcher and launch/train.py's entry load torch only inside the code that turns a
    Ctrl-C into one line (the package's API loads on first use)."""
    code = ("import sys, ulysses_trainer.__main__, ulysses_trainer.cli.launcher, ulysses_trainer.cli.train; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "from ulysses_trainer import parallelize, shard_batch; assert 'torch' in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=train_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("holder", ["socket", "torch_store"])
def test_a_port_another_job_holds_is_one_line_and_exit_1(tmp_path, holder):
    """The launcher's master port held by another program (a plain socket, or another torch job's store, which
    rank 1 must not join): one line naming the port and the fix, no traceback."""
    import socket

    import torch.distributed as dist

    out = tmp_path / "run"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with socket.socket() as held:
        if holder == "socket":
            held.bind(("127.0.0.1", port))
            held.listen()
        else:  # another job's rendezvous store, as torch's env:// opens it
            other = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
        cmd = train_command(2, ["--max_steps", "1", "--output_dir", str(out)])
        cmd[cmd.index("--master_port") + 1] = str(port)
        proc = subprocess.run(cmd, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
        if holder != "socket":
            del other
    said = proc.stdout + proc.stderr
    errors = [line for line in said.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1, said[-3000:]
    assert len(errors) == 1 and f"127.0.0.1:{port}: that port is in use" in errors[0], said[-3000:]
    assert "--master_port" in errors[0] and "Traceback" not in said, said[-3000:]
    assert not out.exists()
