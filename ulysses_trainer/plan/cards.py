"""The GPUs the planner has measured rates for, by the short name the results' files carry (torch-free).

A device's name (torch.cuda.get_device_name(), `nvidia-smi`'s) picks its card; `plan --gpu NAME` picks one for
another machine. A card not measured gets the nearest measured one, and the plan says so in a note.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Card:
    """One GPU model: its short name, the device-name fragment that identifies it, and its memory as torch
    reports it (GiB: what `plan` assumes with no --gpu_memory_gb), and its HBM bandwidth (vendor's, TB/s)."""

    name: str
    marker: str
    memory_gb: float
    hbm_tbps: float


CARDS: dict[str, Card] = {
    "h100": Card("h100", "H100", 79.2, 3.35),
    "h200": Card("h200", "H200", 139.8, 4.8),
}


def card_of(device_name: str | None) -> str | None:
    """The measured card a device name is (`NVIDIA H100 80GB HBM3` -> h100), None if it is none of them."""
    if not device_name:
        return None
    upper = device_name.upper()
    return next((c.name for c in CARDS.values() if c.marker in upper), None)
