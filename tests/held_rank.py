"""Hold one rank of a launched job at a known point of its work, whatever the machine's load.

`held_env(tmp, part, rank, nth)` writes a `sitecustomize.py` (Python imports it at start-up from PYTHONPATH) into
`tmp` and returns the job's environment with it on PYTHONPATH. In the process whose RANK is `rank`, an audit
hook stops the process (SIGSTOP) the `nth` time it opens a path containing `part` for writing, before it writes.
The test waits for that (`wait_stopped`, an event), acts on a run that cannot move on meanwhile, then continues
the rank (SIGCONT) or kills it. Other processes of the job (the launchers, the other ranks) are untouched.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from tests.dist_utils import JOB_TIMEOUT_S, train_env

_SITE = '''\
import os
import signal
import sys

if os.environ.get("RANK") == {rank!r}:
    _opened = [0]

    def _hold(event, args):
        if event == "open" and isinstance(args[1], str) and args[1][:1] in "wax" and {part!r} in str(args[0]):
            _opened[0] += 1
            if _opened[0] == {nth}:
                os.kill(os.getpid(), signal.SIGSTOP)

    sys.addaudithook(_hold)
'''


def held_env(tmp: Path, part: str, rank: int = 0, nth: int = 1) -> dict[str, str]:
    """train_env() plus the hook: rank `rank` stops itself at its `nth` opening for writing of a path with `part`."""
    hook = tmp / "held_rank"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(_SITE.format(rank=str(rank), part=part, nth=nth))
    env = train_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook), env.get("PYTHONPATH")) if p)
    return env


def _status(pid: int, field: str) -> str | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(field + ":")), None)
    except OSError:
        return None


def is_stopped(pid: int) -> bool:
    return (_status(pid, "State") or "").startswith("T")


def has_pending(pid: int, signum: int) -> bool:
    """The signal waits for the (stopped) process: sent to it, not yet handled (/proc/PID/status ShdPnd)."""
    return _in_mask(pid, "ShdPnd", signum)


def _in_mask(pid: int, field: str, signum: int) -> bool:
    mask = _status(pid, field)
    return mask is not None and bool(int(mask, 16) & (1 << (signum - 1)))


def catches(pid: int, signum: int) -> bool:
    """The process has a handler of its own for the signal (/proc/PID/status SigCgt)."""
    return _in_mask(pid, "SigCgt", signum)


def blocks(pid: int, signum: int) -> bool:
    """The process's main thread blocks the signal (/proc/PID/status SigBlk)."""
    return _in_mask(pid, "SigBlk", signum)


def wait_for(cond, job: subprocess.Popen, what: str, timeout: float = JOB_TIMEOUT_S) -> None:
    """Until cond() holds: an event of the job, polled; the timeout only turns a hang into a failure."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert job.poll() is None, f"the job ended (exit {job.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout:g} s"
        time.sleep(0.05)
