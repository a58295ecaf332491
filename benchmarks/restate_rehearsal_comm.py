"""Re-add a rehearsal's modelled communication with today's all-to-all stall term, keeping what it measured.

    python benchmarks/restate_rehearsal_comm.py benchmarks/results/rehearsal/rehearse_*.json

A rehearsal's `predicted_step_s` is its measured `compute_s` plus `comm_s_estimate`, whose stall part is
`a2a_stall_s_per_gb` x the all-to-all GB per rank (plan/comm_model.py). When that constant is re-calibrated (from
the very rehearsals it then applies to), this rewrites the stall, `comm_s_estimate`, `predicted_step_s` and
`tokens_per_s_predicted` of each file, and records the constant it ran with under `comm.restated_from`.
Nothing measured (compute, memory, the collectives' counts and wire time) changes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ulysses_trainer.plan.comm_model import A2A_STALL_S_PER_GB  # noqa: E402


def restate(r: dict, s_per_gb: float) -> dict:
    comm = r["comm"]
    old = comm["overlap"]["a2a_stall_s_per_gb"]
    stall = s_per_gb * comm["by_op"].get("all_to_all", {"bytes": 0})["bytes"] / 1e9
    comm["comm_s_estimate"] += stall - comm["a2a_stall_s"]
    comm["a2a_stall_s"], comm["overlap"]["a2a_stall_s_per_gb"] = stall, s_per_gb
    comm.setdefault("restated_from", {"a2a_stall_s_per_gb": old})
    r["comm_s_estimate"] = comm["comm_s_estimate"]
    if r.get("compute_s") is not None:
        r["predicted_step_s"] = r["compute_s"] + r["comm_s_estimate"]
        r["tokens_per_s_predicted"] = r["tokens_per_step"] / r["predicted_step_s"]
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--a2a_stall_s_per_gb", type=float, default=A2A_STALL_S_PER_GB)
    a = ap.parse_args(argv)
    for path in a.files:
        with open(path) as f:
            r = json.load(f)
        if r.get("status") != "ok":
            continue
        r = restate(r, a.a2a_stall_s_per_gb)
        with open(path + ".tmp", "w") as f:
            f.write(json.dumps(r, indent=1) + "\n")
        os.replace(path + ".tmp", path)
        predicted = r["predicted_step_s"]
        print(f"{path}: comm {r['comm_s_estimate']:.3f} s, predicted "
              f"{'n/a' if predicted is None else f'{predicted:.2f} s/step'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
