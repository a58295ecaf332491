"""A rank's view of a peer that ended: the notice cli/node_launcher.py writes to each surviving rank's pipe
(`rank 1 was killed by signal 9 (SIGKILL)`), read when this rank's own work fails or waits on that peer."""

from __future__ import annotations

import os
import re
import select
import time

NOTICE_FD_ENV = "ULYSSES_TRAINER_NOTICE_FD"
# what a collective says when its peer is gone (gloo, NCCL, the store): worth waiting for the launcher's notice
_LOST_PEER = re.compile(r"Connection (reset|closed|refused)|Broken pipe|peer|Socket|NCCL|timed out|recv|send",
                        re.IGNORECASE)
LOST_PEER_WAIT_S = 10.0

_seen: list[str] = []


def has_channel() -> bool:
    """Started by the trainer's per-node launcher (under `deepspeed`): notices come."""
    return NOTICE_FD_ENV in os.environ


def peer_ended(wait_s: float) -> str | None:
    """The launcher's notice of the first rank that ended (`rank R was killed by ...`), waiting up to wait_s for
    it; None without one (or without the launcher: then after sleeping wait_s, as the old wait did)."""
    if _seen:
        return _seen[0]
    fd = os.environ.get(NOTICE_FD_ENV)
    if not fd:
        time.sleep(wait_s)
        return None
    fd_num = int(fd)
    end = time.monotonic() + wait_s
    data = b""
    while b"\n" not in data:
        left = end - time.monotonic()
        if left <= 0:
            return None
        try:
            ready, _, _ = select.select([fd_num], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd_num, 4096)
        except (OSError, ValueError):
            return None
        if not chunk:  # the launcher ended: no notice will come
            return None
        data += chunk
    _seen.append(data.split(b"\n", 1)[0].decode(errors="replace"))
    return _seen[0]


def lost_peer_line(exc: BaseException, checkpoint: str | None) -> str | None:
    """After this rank's work failed: one line naming the peer that ended and how, if the launcher said so (waits
    longer when the error looks like a lost connection), else None (a failure of this rank's own)."""
    if not has_channel():
        return None
    looks_lost = bool(_LOST_PEER.search(str(exc)))
    notice = peer_ended(LOST_PEER_WAIT_S if looks_lost else 1.0)
    if notice is None:
        return None
    kept = f"the last checkpoint, {checkpoint}, is intact" if checkpoint else "no checkpoint was written yet"
    return f"error: {notice}; this rank stops too ({kept})"
