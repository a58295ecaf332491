"""StopSignal: the first SIGTERM/SIGINT asks for a stop at the step boundary; the launcher's relayed
copy of the same signal does not escalate; a later second signal stops at once."""

import signal

import pytest

from ulysses_trainer.train.stop_signal import InterruptRecorder, StopSignal


def test_relayed_copy_is_the_same_request_and_a_later_signal_stops_now():
    now = [100.0]
    stop = StopSignal(clock=lambda: now[0])
    assert not stop.requested
    stop._handle(signal.SIGINT, None)  # Ctrl-C reaches the rank itself...
    assert stop.requested
    now[0] += 0.05
    stop._handle(signal.SIGTERM, None)  # ...and the launcher's SIGTERM right after: no escalation
    now[0] += StopSignal.RELAY_WINDOW_S
    with pytest.raises(KeyboardInterrupt, match="second signal"):
        stop._handle(signal.SIGTERM, None)


def test_install_routes_sigterm_and_sigint_to_the_handler():
    stop = StopSignal()
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop.install()
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_the_first_request_is_announced_once():
    said = []
    now = [0.0]
    stop = StopSignal(clock=lambda: now[0], on_request=lambda: said.append("saving"))
    stop._handle(signal.SIGINT, None)
    now[0] += 0.01
    stop._handle(signal.SIGTERM, None)  # the relayed copy: no second line
    assert said == ["saving"]


def test_interrupt_recorder_raises_outside_held_and_after_held():
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        seen = InterruptRecorder().install()
        # raise_signal delivers to this thread and runs the Python handler before it returns (os.kill to the
        # process may land on another thread, and the handler then runs at some later bytecode)
        with pytest.raises(KeyboardInterrupt):  # inside `held` only remembered, raised when it ends
            with seen.held():
                signal.raise_signal(signal.SIGINT)
                assert seen.received  # the handler ran and did not raise here
        fresh = InterruptRecorder().install()
        with pytest.raises(KeyboardInterrupt):  # outside: as Python's default, and remembered
            signal.raise_signal(signal.SIGTERM)
        assert fresh.received
        quiet = InterruptRecorder().install()
        with quiet.held():
            pass
        assert not quiet.received
        mine = signal.signal(signal.SIGINT, signal.default_int_handler)  # what a caller of main() had
        again = InterruptRecorder().install()
        again.restore()  # the entry point gives the caller its handlers back
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, mine)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_a_signal_inside_a_finalizer_is_raised_after_it_once():
    """Ctrl-C while a weakref.finalize callback runs (datasets' `Generating train split` has them): raising there
    would print `Exception ignored in: <finalize object ...>` and lose the interruption. It is raised once the
    finalizer has returned, once, however many copies of the signal came."""
    import gc
    import time
    import weakref

    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        seen = InterruptRecorder().install()

        class Held:
            pass

        obj = Held()
        weakref.finalize(obj, lambda: (signal.raise_signal(signal.SIGINT), signal.raise_signal(signal.SIGINT)))
        with pytest.raises(KeyboardInterrupt):
            del obj
            gc.collect()
            time.sleep(2)  # the re-delivery lands here, in ordinary code
        assert seen.received
        signal.raise_signal(signal.SIGTERM)  # a relay of the same Ctrl-C: nothing raised again
    finally:
        for s, h in old.items():
            signal.signal(s, h)
