"""The per-node launcher of `deepspeed ... launch/train.py`: DeepSpeed's `deepspeed.launcher.launch`, for this trainer.

cli/deepspeed_hook.py execs this module in place of DeepSpeed's (same pid, same arguments). It starts the same
ranks with the same environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, CROSS_RANK/SIZE, LOCAL_SIZE, the
accelerator's visible devices, `--local_rank=N`), and differs where DeepSpeed's ends a job badly:

- Ctrl-C / SIGTERM: passed on to the ranks once (they stop at the next step boundary and save, or before training
  say one line) and waited for, however long the save takes; never SIGTERM-then-SIGKILL after 30 s. A second
  signal (more than STOP_REPEAT_S after the first) is passed on too: the ranks stop at once.
- A rank that ends with a non-zero code or a signal: every surviving rank of this node is told which rank ended
  and how (a pipe each, `ULYSSES_TRAINER_NOTICE_FD`), reports it in one line and exits; those that have not ended
  GRACE_S later (a killed rank) or REPORTED_GRACE_S later (a rank that exited with its own error, said by it) are
  killed (a peer stuck in a collective that never fails); for a killed rank this launcher then says the line.
- Exit code: 130 after a Ctrl-C (SIGINT), else 0 if every rank exited 0, else the first failed rank's code if it
  is the trainer's own (2 invalid input, 130), else 1 (a rank killed by a signal is a failure, never 247).
Signals stay blocked (as the runner left them) until the handlers are in place and the ranks are started: the
ranks start with them blocked and unblock once their own handlers exist, so a signal is never lost nor a
traceback.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import subprocess
import sys
import time

from .peer_notice import NOTICE_FD_ENV

GRACE_S = 30.0  # after a rank was killed: the survivors' time to report it and exit by themselves
# after a rank exited with an error of its own (it said it; the others usually fail alike): their time to exit, then
# they are ended as DeepSpeed's launcher ends them (a peer inside a NCCL collective would wait for its timeout)
REPORTED_GRACE_S = 5.0
STOP_REPEAT_S = 2.0  # a signal within this of the first is the same request (the runner relays what the group got)
_POLL_S = 0.1


def _parse(argv: list[str]) -> argparse.Namespace:
    """deepspeed.launcher.launch's arguments (those the hook lets through)."""
    p = argparse.ArgumentParser(prog="ulysses_trainer.cli.node_launcher")
    p.add_argument("--node_rank", type=int, default=0)
    p.add_argument("--master_addr", default="127.0.0.1")
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument("--world_info", default="None")
    p.add_argument("--module", action="store_true")
    p.add_argument("--no_local_rank", action="store_true")
    p.add_argument("--enable_each_rank_log", default="None")
    p.add_argument("--log_level", default="info")
    p.add_argument("-q", "--quiet", action="store_true")
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p.parse_args(argv)


def how_it_ended(code: int) -> str:
    """A rank's exit status in words: `was killed by signal 9 (SIGKILL)` or `exited with code 1`."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        return f"was killed by signal {-code} ({name})"
    return f"exited with code {code}"


def _rank_layout(world_info: dict, node_rank: int) -> tuple[list[int], list, int]:
    """(this node's global ranks, its device ids, the world size), as DeepSpeed numbers them: node by node."""
    nodes = list(world_info)
    first = sum(len(world_info[n]) for n in nodes[:node_rank])
    ids = world_info[nodes[node_rank]]
    return list(range(first, first + len(ids))), ids, sum(len(v) for v in world_info.values())


def _rank_env(args: argparse.Namespace, world_info: dict) -> tuple[dict[str, str], list[int]]:
    env = dict(os.environ)
    ranks, ids, world_size = _rank_layout(world_info, args.node_rank)
    from deepspeed.accelerator import get_accelerator  # the accelerator's visible-device variables, as DeepSpeed's

    get_accelerator().set_visible_devices_envs(env, ids)
    env.update(MASTER_ADDR=args.master_addr, MASTER_PORT=str(args.master_port), WORLD_SIZE=str(world_size),
               CROSS_RANK=str(args.node_rank), CROSS_SIZE=str(len(world_info)), LOCAL_SIZE=str(len(ids)))
    return env, ranks


class _Ranks:
    """This node's rank processes, a notice pipe each."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str], ranks: list[int]) -> None:
        self.procs: dict[int, subprocess.Popen] = {}
        self.notices: dict[int, int] = {}  # rank -> the write end of its pipe
        for local, rank in enumerate(ranks):
            cmd = [sys.executable, "-u", *(["-m"] if args.module else []), args.training_script,
                   *([] if args.no_local_rank else [f"--local_rank={local}"]), *args.training_script_args]
            read, write = os.pipe()
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(local), **{NOTICE_FD_ENV: str(read)})
            self.procs[rank] = subprocess.Popen(cmd, env=rank_env, pass_fds=(read,))
            os.close(read)
            self.notices[rank] = write

    def alive(self) -> list[int]:
        return [r for r, p in self.procs.items() if p.poll() is None]

    def signal(self, signum: int) -> None:
        for r in self.alive():
            try:
                self.procs[r].send_signal(signum)
            except ProcessLookupError:
                pass

    def tell(self, line: str) -> None:
        """The notice to every rank still running (one line; a rank reads it when its collectives fail)."""
        for r in self.alive():
            try:
                os.write(self.notices[r], (line + "\n").encode())
            except OSError:  # it ended meanwhile
                pass

    def kill_tree(self, rank: int) -> None:
        import psutil

        try:
            proc = psutil.Process(self.procs[rank].pid)
            for p in [*proc.children(recursive=True), proc]:
                p.kill()
        except psutil.Error:
            pass


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    world_info = json.loads(base64.urlsafe_b64decode(args.world_info))
    env, ranks = _rank_env(args, world_info)

    requests: list[tuple[int, float]] = []

    def on_signal(signum: int, frame) -> None:
        now = time.monotonic()
        if requests and now - requests[-1][1] <= STOP_REPEAT_S:
            return  # the same Ctrl-C (the group's and the runner's relay)
        requests.append((signum, now))
        job.signal(signum)

    job = None
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    job = _Ranks(args, env, ranks)  # started with SIGINT/SIGTERM blocked, as this process is until now
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # a pending one lands here

    failed: tuple[int, int] | None = None  # (rank, code) of the first rank that failed
    deadline = None
    while job.alive():
        time.sleep(_POLL_S)
        if failed is None:
            for r, p in job.procs.items():
                code = p.poll()
                if code not in (None, 0) and not (requests and code == 130):  # 130: it took the Ctrl-C
                    failed = (r, code)
                    job.tell(f"rank {r} {how_it_ended(code)}")
                    deadline = time.monotonic() + (GRACE_S if code < 0 else REPORTED_GRACE_S)
                    break
        elif deadline is not None and time.monotonic() > deadline:
            stuck = job.alive()
            for r in stuck:
                job.kill_tree(r)
            if stuck and failed[1] < 0:  # a rank that exited with a code has said why itself
                print(f"error: rank {failed[0]} {how_it_ended(failed[1])}; ranks {', '.join(map(str, stuck))} did "
                      f"not stop within {GRACE_S:g} s and were killed; the last checkpoint is intact",
                      file=sys.stderr, flush=True)
            deadline = None
    for p in job.procs.values():
        p.wait()
    if requests and requests[0][0] == signal.SIGINT:
        return 130
    if failed is None:
        return next((p.returncode for p in job.procs.values() if p.returncode), 0)
    return failed[1] if failed[1] in (2, 130) else 1


if __name__ == "__main__":
    sys.exit(main())
