"""Rank processes forked from a server that has already imported torch, DeepSpeed, transformers and the trainer.

On the 2-core CI machine a new rank spends about 10 s of CPU importing before it does any work, and the
`deepspeed` launcher adds two more such processes per job (its runner and its per-node launcher). Most of the
suite is such start-up. Here one fork server per test worker imports all of it once; each rank is a fork of it
that then runs exactly what a launched rank runs (`ulysses_trainer.cli.rank.run()`, or a test's function), with
the environment DeepSpeed's launcher gives a rank.

What this skips is the launcher itself: its signal relay, its killing of the peers of a failed rank, its exit
code. Those are tested through the real `deepspeed` command (test_run_failures, test_faults, test_bad_inputs,
test_readme_examples, test_multinode); the tests that compare numbers between runs start their ranks here.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Imported once by the server: what every rank imports (the trainer, its engine, both model families).
PRELOAD = ["torch", "deepspeed", "deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.muon.muon_optimizer",
           "transformers", "transformers.models.qwen3.modeling_qwen3",
           "transformers.models.qwen3_moe.modeling_qwen3_moe", "ulysses_trainer.cli.train",
           "ulysses_trainer.train.trainer", "ulysses_trainer.parallel.init", "tests.dist_utils"]


def context() -> Any:
    """The fork-server context, its server started (once per process) with one intra-op thread per rank: the
    server reads OMP_NUM_THREADS when it imports torch, before any rank sets its own environment."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return ctx


def rank_environment(base: dict[str, str], rank: int, world_size: int, port: int) -> dict[str, str]:
    """What DeepSpeed's launcher sets for a rank of a one-node job (deepspeed/launcher/launch.py)."""
    return dict(base, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                CROSS_RANK="0", CROSS_SIZE="1", OMP_NUM_THREADS="1")


def adopt(env: dict[str, str]) -> None:
    """In a forked rank: the environment it would have been started with, one intra-op thread."""
    os.environ.clear()
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)


def _trainer_rank(env: dict[str, str], argv: list[str], out_path: str, err_path: str, script: str | None = None
                  ) -> None:
    """A forked rank of `deepspeed launch/train.py ARGV` (or of `deepspeed SCRIPT ARGV`): its stdout and stderr
    appended to the job's two files."""
    adopt(env)
    for fd, path in ((1, out_path), (2, err_path)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), fd)
    sys.stdout.reconfigure(line_buffering=True)  # as under PYTHONUNBUFFERED: the ranks' lines stay whole
    sys.stderr.reconfigure(line_buffering=True)
    if env.get("PYTHONFAULTHANDLER"):  # as a started interpreter reads it: a signal death prints the stack
        import faulthandler

        faulthandler.enable()
    os.chdir(ROOT)
    if script is not None:  # a user's script (examples/): run as its own __main__, exit code from SystemExit
        sys.argv = [os.path.join(ROOT, script), *argv]
        sys.path.insert(0, os.path.dirname(sys.argv[0]))
        import runpy

        runpy.run_path(sys.argv[0], run_name="__main__")
        sys.stdout.flush()
        sys.stderr.flush()
        return
    sys.argv = [os.path.join(ROOT, "launch", "train.py"), *argv]
    from ulysses_trainer.cli.rank import run

    run()  # ends the process with the trainer's exit code


def run_trainer(num_ranks: int, args: list[str], timeout: float, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N launch/train.py ARGS` without the launcher: N forked ranks, their stdout and stderr
    gathered as the launcher's would be. The first rank to fail ends the others (the launcher does the same);
    past `timeout` every rank is killed and subprocess.TimeoutExpired raised, as subprocess.run does."""
    from tests.dist_utils import unverified

    return run_script(num_ranks, None, unverified(args), timeout, env)  # verify_sp as train_command has it


def run_script(num_ranks: int, script: str | None, args: list[str], timeout: float,
               env: dict[str, str] | None = None, launched: bool = True) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N SCRIPT ARGS` (SCRIPT relative to the checkout; None: launch/train.py) without the
    launcher, as run_trainer describes. launched False: `python SCRIPT ARGS` instead (one process, none of the
    launcher's variables), forked all the same."""
    from tests.dist_utils import free_port, train_env

    ctx = context()
    base, port = env or train_env(), free_port()
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (out, err):
            open(path, "w").close()
        assert launched or num_ranks == 1, "a bare python process is one rank"
        procs = [ctx.Process(target=_trainer_rank, daemon=False,
                             args=(rank_environment(base, r, num_ranks, port), [*args, f"--local_rank={r}"], out, err,
                                   script) if launched else (base, list(args), out, err, script))
                 for r in range(num_ranks)]
        for p in procs:
            p.start()
        code, deadline = 0, time.monotonic() + timeout
        try:
            while any(p.exitcode is None for p in procs):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired(["ranks", *args], timeout)
                multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=left)
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:  # its peers are ended below
                    code = failed[0]
                    break
        finally:
            for p in procs:
                if p.exitcode is None:
                    p.kill()
                p.join()
        with open(out) as f_out, open(err) as f_err:
            return subprocess.CompletedProcess(["ranks", "--master_port", str(port), "--num_gpus", str(num_ranks),
                                                script or "launch/train.py", *args], code,
                                               f_out.read(), f_err.read())


def run_bare(args: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python launch/train.py ARGS` (one process, no launcher) as a fork of the server; tests/test_export.py
    starts that command itself."""
    return run_script(1, None, args, timeout, env, launched=False)
