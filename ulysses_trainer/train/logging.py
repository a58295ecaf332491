"""The reference-style log line on stdout (`{'loss': ..., 'grad_norm': ..., ...}`) and metrics.jsonl
(one JSON object per logged step, full float precision)."""

from __future__ import annotations

import json
import os


def log_line(row: dict) -> str:
    """`{'loss': 4.311, 'grad_norm': 29.25, 'learning_rate': 1e-05, 'num_tokens': 1049000.0, 'epoch': 0.25}`;
    a sparse (MoE) model's row ends with its `'aux_loss'` (the router's load-balancing loss, in `loss` times
    router_aux_loss_coef)."""
    shown = {"loss": round(row["loss"], 4), "grad_norm": round(row["grad_norm"], 4),
             "learning_rate": row["learning_rate"], "num_tokens": float(row["num_tokens"]),
             "epoch": round(row["epoch"], 4)}
    if row.get("aux_loss") is not None:
        shown["aux_loss"] = round(row["aux_loss"], 4)
    return str(shown)


class MetricsFile:
    """Appends one JSON object per logged step (metrics.jsonl; events.jsonl: what happened at a step that is not a
    logged step, e.g. a config change at a resume); on resume drops rows past the checkpoint's step."""

    def __init__(self, output_dir: str, name: str = "metrics.jsonl"):
        self.path = os.path.join(output_dir, name)

    def truncate_after(self, step: int) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            rows = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(rows)
        os.replace(tmp, self.path)

    def append(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
