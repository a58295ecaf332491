"""`deepspeed launch/train.py [--config RECIPE.yaml] [--name value ...]`: parse, check, train.

Exit codes: 0 success or clean stop on SIGTERM or Ctrl-C (the job's launcher turns a Ctrl-C's into 130); 2
invalid input, reported before any heavy work with nothing written; 130 Ctrl-C before training started (nothing
written); 1 any other failure (a peer rank that died, named in one line; a
failed write into output_dir, a non-finite step, out of GPU memory, a second Ctrl-C, a process group that
could not start, e.g. on a port another job holds).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback

from ..errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, TrainerError
from ..train.stop_signal import InterruptRecorder
from .deepspeed_hook import INTERRUPTED_BEFORE_TRAINING
from .peer_notice import has_channel, lost_peer_line, peer_ended

# A non-main rank waits this long before reporting its error itself: the launcher ends it as soon as
# rank 0 (which fails the same way and prints) exits, so the message appears once, not per rank.
_PEER_REPORT_DELAY_S = 5.0


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _report(message: str) -> None:
    """One line on stderr from rank 0; other ranks print only if rank 0 has not ended them first."""
    message = " ".join(message.split())  # one line, even where a library's error text had several
    if _rank() != 0:
        for sig in (signal.SIGTERM, signal.SIGINT):  # the launcher's SIGTERM must end this wait
            signal.signal(sig, signal.SIG_DFL)
        if peer_ended(_PEER_REPORT_DELAY_S) is not None and has_channel():
            return  # a peer (rank 0, failing alike) ended first and has said it
        message = f"(rank {_rank()}) {message}"
    print(message, file=sys.stderr, flush=True)


def _quiet_wait() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    time.sleep(_PEER_REPORT_DELAY_S)


def _latest_checkpoint(output_dir: str | None) -> str | None:
    try:
        with open(os.path.join(output_dir or "", "latest")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _peer_failure(exc: BaseException, output_dir: str | None) -> bool:
    """This rank's error came from a peer that ended (the launcher said which and how): say that in one line."""
    line = lost_peer_line(exc, _latest_checkpoint(output_dir))
    if line is None:
        return False
    print(line if _rank() == 0 else f"(rank {_rank()}) {line}", file=sys.stderr, flush=True)
    return True


def interrupted() -> int:
    """Ctrl-C before training started: one line from rank 0 instead of a traceback per rank."""
    if _rank() == 0:
        print(INTERRUPTED_BEFORE_TRAINING, file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launched() -> bool:
    """Started by a launcher (deepspeed, torchrun): its ranks must agree on one plan."""
    return "RANK" in os.environ or "WORLD_SIZE" in os.environ


def _init_distributed() -> None:
    """The process group (once). A launched job starts it before the checks, so that the ranks plan from one
    agreed machine; a bare `python launch/train.py` has one rank and starts it after them."""
    import torch

    from ..parallel.init import group_started, init_distributed

    if group_started():
        return  # started before the checks (a launched job)
    store = None
    if not _launched():
        # `python launch/train.py` without a launcher: a one-rank group (DeepSpeed would try MPI)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    else:  # several ranks: the store on the master port must be this job's before torch's rendezvous joins it
        from ..parallel.rendezvous import check_one_job, job_token

        store = check_one_job(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), _rank(),
                              int(os.environ["WORLD_SIZE"]), job_token())
    cuda = torch.cuda.is_available()
    if cuda:  # each rank's own GPU before the first collective (NCCL keys its communicator on it)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    init_distributed("nccl" if cuda else "gloo", store=store)


def _end_group() -> None:
    """After a failure in the checks: end the process group if one was started (the peers fail alike)."""
    from ..parallel.init import destroy_distributed

    destroy_distributed(together=False)


def _fitting_plan(argv: list[str], pinned: tuple[str, ...], world_size: int) -> str:
    """After an out-of-memory error: the plan command that searches the levers the run had pinned."""
    from .argv import plan_command

    command = plan_command(argv, pinned, world_size)
    if pinned:
        return f"for a plan that fits run: {command}"
    return (f"every lever was auto, so the memory model under-predicted this run: shorten max_length or add GPUs "
            f"(sp); the plan's terms: {command}")


def format_help() -> str:
    """`--help`: every config field with its type, default and help line."""
    import dataclasses
    import json

    from ..config import HINTS, TrainConfig
    from ..config.typed_values import describe

    lines = ["usage: deepspeed [--num_gpus N] launch/train.py [--config RECIPE.yaml] [--name value ...]", "",
             "  --config (a path; default none)",
             "      a YAML recipe of `name: value` lines (launch/recipes/); --name value on the command line "
             "overrides it"]
    for f in dataclasses.fields(TrainConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  --{f.name} ({describe(HINTS[f.name])}; default {json.dumps(default)})")
        lines.append(f"      {f.metadata.get('help', '')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    seen = InterruptRecorder().install()  # until the trainer's own handler: Ctrl-C raises, and is remembered
    try:
        return _main(argv, seen)
    finally:
        seen.restore()


def _main(argv: list[str], seen: InterruptRecorder) -> int:
    prepared = None
    try:
        with seen.held():  # torch and transformers import here: a Ctrl-C waits for them to finish
            from ..parallel.init import destroy_distributed
            from ..train.prepare import prepare, world_size_from_env
            from .argv import load_config
            from .console import use_console

        use_console()
        if "--help" in argv or "-h" in argv:
            if _rank() == 0:  # under a launcher every rank parses the same argv
                print(format_help())
            return EXIT_OK
        cfg = load_config(argv)
        if _launched():
            _init_distributed()
        prepared = prepare(cfg, world_size_from_env())
        with seen.held():
            from ..train.trainer import Trainer
        _init_distributed()
        code = Trainer(prepared).train() or EXIT_OK
        destroy_distributed(together=True)
        return code
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - every failure, and a Ctrl-C before the trainer's
        return _ended_by(exc, seen, argv, prepared)  # stop handler exists (or a second one): one line, its exit code


def _ended_by(exc: BaseException, seen: InterruptRecorder, argv: list[str], prepared) -> int:
    """The exit code of a run that raised `exc`, after its one line: a TrainerError's own line and code (the
    out-of-memory one with the plan command that fits); a Ctrl-C's (130, or 1 for a second one, which says why);
    a peer's death named; a traceback only for a failure nobody named. `plan`: None before the run was prepared."""
    if isinstance(exc, KeyboardInterrupt):
        if str(exc):  # the stop handler's second signal: it says what it cut short
            print(f"[ulysses_trainer] interrupted: {exc}", file=sys.stderr, flush=True)
            code = EXIT_FAILURE
        else:
            code = interrupted()
        _end_group()
        return code
    if isinstance(exc, TrainerError):
        pinned = getattr(exc, "pinned", None)  # train/out_of_memory.OutOfGpuMemory: the levers the run had pinned
        hint = f"; {_fitting_plan(argv, pinned, prepared.world_size)}" if pinned is not None and prepared else ""
        _report(f"error: {exc}{hint}")
        if exc.end_group:  # no collective where a peer may be inside one: the process's exit ends the group
            _end_group()
        return exc.exit_code
    if seen.received:  # the Ctrl-C, turned into another error by a library on its way up
        _end_group()
        return interrupted()
    if _peer_failure(exc, prepared.cfg.output_dir if prepared else None):  # its cause in one line, not gloo's traceback
        return EXIT_FAILURE  # the group is left to the process's exit: a collective with the dead peer hangs
    if _rank() != 0 and prepared is not None:  # usually a peer's failure seen here ("Connection closed by peer"):
        _quiet_wait()  # let the rank that failed first report; the launcher ends this one meanwhile
    traceback.print_exception(exc)
    _end_group()
    return EXIT_FAILURE
