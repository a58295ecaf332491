"""The `deepspeed` command's own processes, when they launch this trainer: a clean Ctrl-C and a named dead rank.

`deepspeed --num_gpus N launch/train.py` starts DeepSpeed's runner, which starts its per-node launcher
(`python -m deepspeed.launcher.launch`), which starts the ranks. Left alone, a Ctrl-C to the terminal's process
group ends the runner at once with a KeyboardInterrupt traceback while the ranks still save, the launcher kills
the ranks 30 s later, and a rank that dies of a signal makes the job exit 247 (-9 as a byte) after the survivors'
gloo tracebacks. No code of the trainer runs in those two processes, except this, twice:

- `guard_start`, at interpreter start-up: the installed package puts `00-ulysses_trainer-runner.pth` in
  site-packages (setup.py), whose one line Python's `site` runs before the program; when the command line names
  deepspeed it runs this file (not the package: an editable install's import hook is not in place yet). In the
  runner it takes SIGINT and SIGTERM from then until `install` (torch's import, the command's first seconds):
  the one line and exit 130. Only a Ctrl-C in the interpreter's own start, before `site` reads the .pth
  files (its first tens of ms), is Python's: killed by SIGINT, or `Fatal Python error: init_import_site`.
- `install`: torch imports every installed `torch.backends` entry point (pyproject.toml names it), and both
  processes import torch (through `deepspeed`) before they do anything else.

Both act only when the process is one of those two launching this trainer (launch/train.py, or
`--module ulysses_trainer.cli.rank`); in any other process they return at once, changing nothing.

- The runner: SIGINT and SIGTERM are blocked in its main thread (so also in every process it starts, until their
  own handlers are in place: blocked signals stay pending, never lost) and a thread takes them: before the
  per-node launcher exists it says the one line and exits 130; after, it passes the signal on to it and the
  runner waits for the launcher's exit code, which it returns as its own.
- The per-node launcher: replaced (exec, same pid) by cli/node_launcher.py, which starts the same ranks.

TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns both off (DeepSpeed's own behaviour). A multi-node runner (a hostfile) is
left as DeepSpeed has it; its per-node launchers are replaced as on one node.
"""

from __future__ import annotations

import _thread  # the standard library only, no module of the package: the start-up .pth runs this file alone
import os
import sys

_RANK_MODULE = "ulysses_trainer.cli.rank"
_NODE_LAUNCHER = "ulysses_trainer.cli.node_launcher"
# DeepSpeed launcher options that cli/node_launcher.py does not implement: with any of them DeepSpeed's stays
_UNSUPPORTED = ("--save_pid", "--bind_cores_to_rank", "--bind_core_list", "--no_python")
INTERRUPTED_BEFORE_TRAINING = "[ulysses_trainer] interrupted before training: nothing written"
_EXITING = _thread.allocate_lock()  # the line once, though the main thread and the signal thread both take signals


def guard_start() -> bool:
    """The installed .pth file's call at interpreter start-up: in the runner, Ctrl-C / SIGTERM before `install`
    runs say the one line and exit 130 (no rank exists yet). Never raises; any other process: nothing (False)."""
    try:
        # torch's switch for its entry points (install) turns this off too
        if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") == "0" or launch_role(_cmdline())[0] != "runner":
            return False
        import _signal  # not signal: its enum import would widen the window this closes by tens of ms

        for sig in (_signal.SIGINT, _signal.SIGTERM):
            _signal.signal(sig, _handle)
        return True
    except Exception:  # noqa: BLE001 -- DeepSpeed's behaviour then, never a failed start
        return False


def install() -> None:
    """torch.backends entry point: never raises (an error here would fail `import torch` in every process)."""
    try:
        role, rest = launch_role(_cmdline())
        if role == "runner":
            _guard_runner()
        elif role == "node_launcher":
            sys.stdout.flush()
            os.execv(sys.executable, [sys.executable, "-u", "-m", _NODE_LAUNCHER, *rest])
    except Exception:  # noqa: BLE001 -- DeepSpeed's behaviour then, never a failed import
        pass


def _cmdline() -> list[str]:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:  # not Linux: sys.argv is not final while an import runs under `python -m`; act on nothing
        return []


def is_trainer_script(path: str) -> bool:
    """launch/train.py of a checkout of this trainer (any copy: the file names the rank entry)."""
    if os.path.basename(path) != "train.py" or os.path.basename(os.path.dirname(os.path.abspath(path))) != "launch":
        return False
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return _RANK_MODULE in f.read(4096)
    except OSError:
        return False


def _program(argv: list[str]) -> tuple[str, list[str]]:
    """(the script or `-m` module the interpreter runs, its arguments), skipping the interpreter's own options."""
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "-m" and i + 1 < len(argv):
            return "-m " + argv[i + 1], argv[i + 2:]
        if a.startswith("-m") and len(a) > 2:
            return "-m " + a[2:], argv[i + 1:]
        if a in ("-c",) or a == "-":
            return "", []
        if not a.startswith("-"):
            return a, argv[i + 1:]
        i += 2 if a in ("-W", "-X", "-Q") else 1
    return "", []


def _launches_trainer(args: list[str], module: bool) -> bool:
    for i, a in enumerate(args):
        if is_trainer_script(a) or (a == _RANK_MODULE and (module or (i and args[i - 1] == "--module"))):
            return True
    return False


def launch_role(argv: list[str]) -> tuple[str, list[str]]:
    """("runner" | "node_launcher" | "", the program's arguments) of a process with this command line."""
    program, rest = _program(argv)
    if program in ("-m deepspeed.launcher.runner",) or os.path.basename(program) == "deepspeed":
        if _launches_trainer(rest, "--module" in rest) and not _multi_node(rest):
            return "runner", rest
    elif program == "-m deepspeed.launcher.launch":
        options = [a for a in rest if a.startswith("--")]
        script = next((a for a in rest if not a.startswith("--")), "")
        if any(o.split("=")[0] in _UNSUPPORTED for o in options):
            return "", rest
        if any(o.startswith("--enable_each_rank_log=") and o.split("=", 1)[1] != "None" for o in options):
            return "", rest
        if is_trainer_script(script) or (script == _RANK_MODULE and "--module" in options):
            return "node_launcher", rest
    return "", rest


def _multi_node(args: list[str]) -> bool:
    """A runner that may start other nodes (pdsh, ssh): it keeps DeepSpeed's own signal handling."""
    return any(a.split("=")[0] in ("--hostfile", "--num_nodes", "--force_multi", "--launcher") for a in args) \
        or os.path.isfile("/job/hostfile")  # DeepSpeed's default hostfile


def _guard_runner() -> None:
    import signal
    import threading

    sigs = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)  # this thread, and so every process the runner starts

    def take() -> None:
        while True:
            _take(signal.sigwait(sigs))

    threading.Thread(target=take, name="ulysses_trainer-signals", daemon=True).start()


def _handle(signum: int, frame: object) -> None:
    """guard_start's handler (Python runs it in the main thread; after _guard_runner only a signal delivered to a
    thread that left it unblocked reaches it)."""
    _take(signum)


def _take(signum: int) -> None:
    """A signal to the runner: passed on to the per-node launcher, or before there is one, the line and exit 130."""
    children = _children(os.getpid())
    if not children:  # no launcher yet: the job never started
        if _EXITING.acquire(False):  # else the other taker is saying it and exiting
            os.write(2, f"{INTERRUPTED_BEFORE_TRAINING}\n".encode())  # not print: the main thread may be printing
            os._exit(130)
        return
    for pid in children:  # a signal sent to the runner alone; the launcher treats a repeat as one
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _children(pid: int) -> list[int]:
    out = []
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            out = [int(p) for p in f.read().split()]
    except OSError:
        pass
    return out
