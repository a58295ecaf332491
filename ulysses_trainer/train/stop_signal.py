"""SIGTERM/SIGINT during training: a stop request at the next step boundary, a second signal at once."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

# A KeyboardInterrupt raised in a finalizer (weakref.finalize, __del__) is printed as `Exception ignored in:` and
# lost: the run would go on. These frames mark one; the signal is delivered again once the finalizer has returned.
_FINALIZER_FILES = ("weakref.py", os.path.join("multiprocessing", "util.py"))
REDELIVER_S = 0.05


def in_finalizer(frame: FrameType | None) -> bool:
    """The interrupted code runs inside a finalizer (an exception raised there is ignored, not propagated)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or (code.co_name in ("__call__", "_run_finalizers", "_exitfunc")
                                         and code.co_filename.endswith(_FINALIZER_FILES)):
            return True
        frame = frame.f_back
    return False


class StopSignal:
    """SIGTERM/SIGINT: stop at the next step boundary and save; a second signal stops at once.

    A second signal within RELAY_WINDOW_S of the first is the same request: on Ctrl-C (or a signal
    sent to the whole job) each rank gets the signal itself and, milliseconds later, the copy that its
    per-node launcher relays (the trainer's passes the SIGINT on, DeepSpeed's own a SIGTERM).
    """

    RELAY_WINDOW_S = 2.0

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 on_request: Callable[[], None] | None = None) -> None:
        self.requested = False
        self._clock, self._first = clock, 0.0
        self._on_request = on_request  # says once what the stop will do ("interrupted: saving at the next ...")

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        now = self._clock()
        if self.requested and now - self._first > self.RELAY_WINDOW_S:
            if in_finalizer(frame):  # it would be ignored there: again once the finalizer returned
                threading.Timer(REDELIVER_S, os.kill, (os.getpid(), signum)).start()
                return
            raise KeyboardInterrupt(f"second signal {signum}: stopping now")
        if not self.requested:
            self.requested, self._first = True, now
            if self._on_request is not None:
                self._on_request()


class InterruptRecorder:
    """Before the trainer's StopSignal: Ctrl-C / SIGTERM raise KeyboardInterrupt as Python's default does, and
    are remembered, because a library may turn the KeyboardInterrupt into another error on its way up
    (transformers' lazy imports re-raise it as ModuleNotFoundError): the entry point then still reports an
    interruption, not that error."""

    def __init__(self) -> None:
        self.received, self._held, self._raised = False, False, False
        self._before: dict[int, object] = {}

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Inside the block a signal is only remembered, and raised as KeyboardInterrupt when it ends: for
        imports, where a KeyboardInterrupt inside a C extension's initialization can abort the process."""
        self._held = True
        try:
            yield
        finally:
            self._held = False
        if self.received and not self._raised:
            self._raised = True
            raise KeyboardInterrupt

    def install(self) -> InterruptRecorder:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._before[sig] = signal.signal(sig, self._handle)
        # under `deepspeed`, the ranks start with both blocked (cli/deepspeed_hook.py): one sent meanwhile lands now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
        return self

    def restore(self) -> None:
        """The handlers from before install (a caller of the entry point in its own process keeps its own)."""
        for sig, handler in self._before.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self._raised:  # the same Ctrl-C again (the group's and a launcher's relay): raised once, said once
            return
        self.received = True
        if self._held:
            return
        if in_finalizer(frame):  # raising here would be ignored: deliver it again once the finalizer returned
            threading.Timer(REDELIVER_S, os.kill, (os.getpid(), signum)).start()
            return
        self._raised = True
        raise KeyboardInterrupt
