"""output_dir/eval_loss_by_position.png: every evaluation's loss by position (and the recall probe's accuracy by
distance), redrawn from metrics.jsonl's eval rows after each evaluation.

How to read it: a curve that falls with position means the model uses the context before a token to predict
it; one that stops falling (or rises) past the model's native window (the dashed line: the checkpoint's
pretraining length, where YaRN stretches the positions beyond) means the scaled positions did not take. The
probe's accuracy should stay up across the distances the run trains on.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

PLOT = "eval_loss_by_position.png"
POSITION_KEY, RECALL_KEY = "eval_loss_by_position", "eval_recall_by_distance"


def native_window(model_config: Any) -> int | None:
    """The positions the checkpoint was pretrained on: YaRN's original_max_position_embeddings, else
    max_position_embeddings (None when the config has neither). A multimodal config: its text model's."""
    model_config = getattr(model_config, "text_config", None) or model_config
    for name in ("rope_parameters", "rope_scaling"):
        rope = getattr(model_config, name, None)
        if isinstance(rope, dict) and rope.get("original_max_position_embeddings"):
            return int(rope["original_max_position_embeddings"])
    window = getattr(model_config, "max_position_embeddings", None)
    return int(window) if window else None


def eval_rows(metrics_path: str) -> list[dict]:
    """The eval rows of metrics.jsonl that carry the loss by position, in order."""
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if POSITION_KEY in r]


def _short(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _x_of(position: int, edges: list[int]) -> float | None:
    """Where a position falls on the bucket axis (bucket b drawn at x = b, spanning b - 0.5 .. b + 0.5)."""
    for b, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        if lo <= position < hi:
            frac = math.log(position / lo) / math.log(hi / lo) if lo > 0 else position / hi
            return b - 0.5 + frac
    return None


def plot_eval_by_position(rows: list[dict], path: str, window: int | None = None, title: str = "") -> None:
    """Write the PNG: one curve per eval row (the latest darkest), the native window's line where it falls
    inside max_length, and a second panel with the recall accuracy when the rows carry it."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt

    probe = any(RECALL_KEY in r for r in rows)
    fig, axes = plt.subplots(1, 2 if probe else 1, figsize=(12 if probe else 7, 4.2), dpi=120, squeeze=False)
    cmap = plt.get_cmap("viridis")
    panels = [(axes[0][0], POSITION_KEY, "loss", "mean eval loss (nats)", "position of the token in its document")]
    if probe:
        panels.append((axes[0][1], RECALL_KEY, "accuracy", "facts recalled (teacher-forced)",
                       "distance from the fact to its question (tokens)"))
    for ax, key, field, ylabel, xlabel in panels:
        drawn = [r for r in rows if key in r]
        edges: list[int] = drawn[-1][key]["edges"] if drawn else [0, 1]
        for i, r in enumerate(drawn):
            ys = r[key][field]
            xs = [b for b, y in enumerate(ys) if y is not None]
            last = i == len(drawn) - 1
            shade = 0.85 * (1 - (i + 1) / len(drawn)) if len(drawn) > 1 else 0.0
            ax.plot(xs, [ys[b] for b in xs], marker="o", ms=3, lw=2.0 if last else 1.0, color=cmap(shade),
                    alpha=1.0 if last else 0.6, label=f"step {r['step']}" if last or i == 0 else None)
        x = _x_of(window, edges) if window else None
        if x is not None:
            ax.axvline(x, color="grey", ls="--", lw=1, label=f"native window ({window:,})")
        ax.set_xticks(range(len(edges) - 1))
        ax.set_xticklabels([f"{_short(lo)}-{_short(hi)}" for lo, hi in zip(edges[:-1], edges[1:])], rotation=45,
                           ha="right", fontsize=7)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if key == RECALL_KEY:
            ax.set_ylim(-0.03, 1.03)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or "eval loss by position")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path.removesuffix(".png") + ".tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)  # a reader never sees half a PNG
