"""Where the package keeps what it can rebuild (prepared rows, the converted tokenizer):
$XDG_CACHE_HOME/ulysses_trainer, else ~/.cache/ulysses_trainer; None without a home directory."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir(*parts: str) -> Path | None:
    """The package's cache directory (or a subdirectory of it); it may not exist yet."""
    base = os.environ.get("XDG_CACHE_HOME") or (str(Path.home() / ".cache") if os.environ.get("HOME") else None)
    return Path(base, "ulysses_trainer", *parts) if base else None
