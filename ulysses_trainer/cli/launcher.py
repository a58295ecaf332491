"""`ulysses-trainer train [--num_gpus N] [--master_port P] [--config RECIPE] [--name value ...]`: the
`deepspeed` command on one node, with Ctrl-C that waits for the save.

Under `deepspeed launch/train.py` a Ctrl-C reaches every process of the terminal's group, which the trainer's hook
in DeepSpeed's runner and per-node launcher (cli/deepspeed_hook.py) turns into the same stop. Here the job runs in
its own session, so the terminal's Ctrl-C reaches only this process, which then:
- first Ctrl-C (or SIGTERM): sends SIGINT to the rank processes only (not to DeepSpeed's launcher). They
  stop at the next step boundary and save; rank 0 says `interrupted: saving at the next step boundary`.
  This command returns when the launcher has seen every rank finish: 130 after a clean stop on Ctrl-C (0 on
  SIGTERM), as `deepspeed launch/train.py` does. Before training started the ranks say `interrupted before
  training: nothing written` (exit 130).
- second Ctrl-C: SIGKILL to the whole job at once. The save in progress is lost, its temporary directory
  is removed; the previous checkpoint and `latest` are intact (a checkpoint is renamed into place only
  when complete). Exit 130.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time

from ..errors import EXIT_INTERRUPTED, EXIT_INVALID, ConfigError
from .argv import split_argv
from .train import INTERRUPTED_BEFORE_TRAINING

_POLL_S = 0.2


_RUNNER_OPTIONS = {"num_gpus", "master_port", "num_nodes", "hostfile", "include", "exclude"}


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the deepspeed runner's options, the trainer's arguments)."""
    return split_argv(argv, own=_RUNNER_OPTIONS, flags=set(), others="rest")


def _session_members(sid: int) -> list[tuple[int, bytes]]:
    """(pid, command line) of the processes whose process group is `sid` (Linux /proc)."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) != sid:  # fields after the command: state, ppid, pgrp, ...
                continue
            pid = int(stat.split("/")[2])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out.append((pid, f.read()))
        except (OSError, ValueError, IndexError):  # the process ended meanwhile
            continue
    return out


def _ranks(sid: int) -> dict[int, int]:
    """pid -> local rank of the rank processes (the per-node launcher passes --local_rank=N to them only)."""
    out = {}
    for pid, cmd in _session_members(sid):
        for arg in cmd.split(b"\0"):
            if arg.startswith(b"--local_rank="):
                out[pid] = int(arg.split(b"=", 1)[1] or 0)
    return out


def catches_sigterm(pid: int) -> bool:
    """The process has a handler for SIGTERM (/proc/PID/status SigCgt): the trainer's entry point installs one
    for SIGINT and SIGTERM before anything else, Python's own start-up catches SIGINT only. Before that a SIGINT
    would end the rank silently (interpreter start) or as a traceback, so it is held back until then."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(mask & (1 << (signal.SIGTERM - 1)))


def _remove_unfinished_saves(output_dir: str | None) -> None:
    if output_dir:
        for tmp in glob.glob(os.path.join(glob.escape(output_dir), ".tmp-checkpoint-*")):
            shutil.rmtree(tmp, ignore_errors=True)


def _output_dir(rest: list[str]) -> str | None:
    from .argv import load_config

    try:
        return load_config(rest).output_dir
    except ConfigError:  # the ranks report bad input themselves
        return None


def _package_parent() -> str:
    """Where this ulysses_trainer is imported from: the ranks (`python -m`) import the same copy from any
    working directory (a checkout run as `python -m ulysses_trainer`, a --target install)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str]) -> int:
    ours, rest = _split(argv)
    if "--help" in rest or "-h" in rest:
        print(__doc__)
        return 0
    deepspeed = shutil.which("deepspeed") or os.path.join(os.path.dirname(sys.executable), "deepspeed")
    if not os.path.exists(deepspeed):
        print("error: the deepspeed command is not installed here (pip install deepspeed)", file=sys.stderr)
        return EXIT_INVALID
    # the package's own rank entry (cli/rank.py), so an installed package needs no checkout
    cmd = [deepspeed, *ours, "--module", "ulysses_trainer.cli.rank", *rest]
    requests: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):  # from here on a Ctrl-C is a request, never a traceback
        signal.signal(sig, lambda signum, frame: requests.append(signum))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_package_parent(),
                                                                  os.environ.get("PYTHONPATH")) if p))
    job = subprocess.Popen(cmd, start_new_session=True, env=env)  # the terminal's Ctrl-C reaches only this process
    delivered: dict[int, int] = {}  # pid -> local rank, of the ranks that were sent the request
    killed = False
    while True:
        try:
            code = job.wait(timeout=_POLL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        if len(requests) >= 2 and not killed:  # second Ctrl-C: stop now
            os.killpg(job.pid, signal.SIGKILL)
            killed = True
        elif requests and not killed:  # ranks that exist now and were not asked yet (some may still start)
            for pid, local_rank in _ranks(job.pid).items():
                if pid in delivered or not catches_sigterm(pid):  # not yet able to take it: next poll
                    continue
                try:
                    os.kill(pid, signal.SIGINT)
                    delivered[pid] = local_rank
                except ProcessLookupError:
                    pass
    while _session_members(job.pid):  # the runner returned; its launcher and ranks may still be ending
        if len(requests) >= 2 and not killed:
            os.killpg(job.pid, signal.SIGKILL)
            killed = True
        time.sleep(_POLL_S)
    if killed:
        _remove_unfinished_saves(_output_dir(rest))
        print("[ulysses_trainer] stopped at once (second Ctrl-C): the save in progress is discarded, the last "
              "checkpoint is intact", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    if requests and code != 0 and 0 not in delivered.values():
        # the job ended before rank 0 could take the request: the runner itself died of the Ctrl-C (it is in this
        # process group for an instant between fork and setsid; exit -2, which used to come back as 254), or the
        # launcher ended the ranks first. Nothing was written (no rank reached training), so say it here.
        print(INTERRUPTED_BEFORE_TRAINING, file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    if requests and code != 0:  # interrupted before training (rank 0 said so), or a failure while stopping
        return EXIT_INTERRUPTED if code in (1, EXIT_INTERRUPTED, 256 - signal.SIGINT, -signal.SIGINT) else code
    if requests and requests[0] == signal.SIGINT:  # stopped and saved at the step boundary: a Ctrl-C's status
        return EXIT_INTERRUPTED
    return code
