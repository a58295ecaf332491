"""Whether the Hugging Face Hub can be reached, asked once with a short timeout before a Hub id is loaded.

transformers retries an unreachable Hub for half a minute and then reports an OSError that does not say the
network is the cause; one probe says so at once.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request

PROBE_TIMEOUT_S = 5.0


def hub_endpoint() -> str:
    """The Hub's address as huggingface_hub reads it (HF_ENDPOINT, read now: a test or a mirror may set it)."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set: the Hub is not asked at all."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "on", "yes", "true")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_unreachable(timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when the Hub answers an HTTP request (any status); else why not, in a few words."""
    url = hub_endpoint()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout_s):
            return None
    except urllib.error.HTTPError:  # it answered
        return None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"{url} did not answer within {timeout_s:g} s ({reason})"
