"""Where the package's log records go when a command runs: one handler on the "ulysses_trainer" logger that writes
`[ulysses_trainer] message` to stdout (stderr for records marked ON_STDERR), flushed per line."""

from __future__ import annotations

import logging
import sys

from ..messages import LOGGER

PREFIX = "[ulysses_trainer] "


class Console(logging.Handler):
    """One line per record, on the stream its record asks for, looked up when it is written (so a test's captured
    stdout, or a stream replaced meanwhile, gets it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if getattr(record, "on_stderr", False) else sys.stdout
            stream.write(PREFIX + record.getMessage() + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own rule: a failed write never stops the program
            self.handleError(record)


def use_console() -> None:
    """Install the handler (once per process) and show INFO and above; the records do not reach the root logger."""
    log = logging.getLogger(LOGGER)
    if not any(isinstance(h, Console) for h in log.handlers):
        log.addHandler(Console())
    log.setLevel(logging.INFO)
    log.propagate = False
