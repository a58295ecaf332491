"""The package's messages go through `logging` (the "ulysses_trainer" logger and its children), never print().

The commands show them as `[ulysses_trainer] message` (cli/console.py): on stdout, or on stderr for a record
logged with `extra=ON_STDERR`. Which rank says a line is the caller's rule (most lines: rank 0 only). A loop of
your own configures logging as it likes; without a handler only warnings show (Python's last-resort handler).
"""

from __future__ import annotations

LOGGER = "ulysses_trainer"
ON_STDERR = {"on_stderr": True}  # `extra=` of a record the commands show on stderr
