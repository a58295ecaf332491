"""First-fit (next_fit, the sessions' order) against best-fit decreasing (bfd) on the GPU: real tokens per second
over an epoch of mixed-length sessions, not only the fill.

    python benchmarks/packing_gpu.py rows --out rows.json            # CPU: pack, pick rows to time
    python benchmarks/packed_step.py --out DIR --phases rows --rows rows.json -- \\
        --config launch/recipes/one_gpu_4b_long.yaml --output_dir /tmp/o/p --overwrite_output_dir true
    python benchmarks/packing_gpu.py epoch --rows rows.json --measured DIR/packed_step.json --out RESULT.json

`rows`: --sessions session lengths drawn from the mixed agent-sessions distribution (data/agent_sessions.py:
log-normal, median 60K, 4K-400K; seed --seed; a session over max_length keeps its first max_length tokens, as
max_length_policy truncate), packed by both strategies with the data pipeline's own rules, and for each
strategy rows at given percentiles of attention work (--pick; sum of l_i^2 / L^2 over the real documents: the
pads are segments of their own that the kernels leave out). A packed row's step costs the same MLP, norms and loss
whatever its documents, plus attention in proportion to that ratio: `epoch` fits step_s = a + b * ratio to the
timed rows and sums it over every row of each strategy's epoch, giving the epoch's time and real tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ulysses_trainer.data.agent_sessions import mixed_session_tokens  # noqa: E402
from ulysses_trainer.data.rows import best_fit_decreasing  # noqa: E402


def next_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Whole documents in their order; a new bin when the next does not fit (packing_strategy next_fit)."""
    bins: list[list[int]] = [[]]
    used = 0
    for n in lengths:
        if used + n > capacity and bins[-1]:
            bins.append([])
            used = 0
        bins[-1].append(n)
        used += n
    return bins


def ratio(row: list[int], capacity: int) -> float:
    """Causal attention work of the row's documents (its pads cost none) over one document of capacity."""
    return sum(n * (n + 1) for n in row) / (capacity * (capacity + 1))


def packings(sessions: int, seed: int, capacity: int) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    lengths = [min(capacity, mixed_session_tokens(rng)) for _ in range(sessions)]
    bfd = [[lengths[i] for i in b] for b in best_fit_decreasing(lengths, capacity)]
    return {"next_fit": next_fit(lengths, capacity), "bfd": bfd}


def rows_cmd(a) -> None:
    packs = packings(a.sessions, a.seed, a.max_length)
    chosen = {}
    for pick in a.pick.split(","):
        name, q = pick.split(":")
        bins = packs[name]
        order = sorted(range(len(bins)), key=lambda i: ratio(bins[i], a.max_length))
        chosen[f"{name}_p{q}"] = bins[order[int(int(q) / 100 * (len(order) - 1))]]
    with open(a.out, "w") as f:
        json.dump(chosen, f, indent=1)
    for name, bins in packs.items():
        real = sum(map(sum, bins))
        print(f"{name}: {len(bins)} rows, fill {real / (len(bins) * a.max_length):.4f}")
    for k, v in chosen.items():
        print(k, len(v), "documents", sum(v), "tokens", f"ratio {ratio(v, a.max_length):.3f}")


def epoch_cmd(a) -> None:
    with open(a.measured) as f:
        measured = json.load(f)
    with open(a.rows) as f:
        rows = json.load(f)
    L = a.max_length
    pts = [(ratio(rows[k[4:]], L), v["step_s"], v["real_tokens"] / v["step_s"])
           for k, v in measured["phases"].items() if k.startswith("row ") and k[4:] in rows]
    n = len(pts)
    mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
    b = sum((p[0] - mx) * (p[1] - my) for p in pts) / sum((p[0] - mx) ** 2 for p in pts)
    fit_a = my - b * mx
    out = {"sessions": a.sessions, "seed": a.seed, "max_length": L, "device": measured.get("device"),
           "fit": {"a_s": fit_a, "b_s": b, "points": [{"ratio": r, "step_s": s, "predicted_s": fit_a + b * r,
                                                       "real_tokens_per_s": t} for r, s, t in pts]},
           "strategies": {}}
    for name, bins in packings(a.sessions, a.seed, L).items():
        real = sum(map(sum, bins))
        secs = sum(fit_a + b * ratio(r, L) for r in bins)
        out["strategies"][name] = {"rows": len(bins), "real_tokens": real, "fill_ratio": real / (len(bins) * L),
                                   "mean_sum_l2_ratio": sum(ratio(r, L) for r in bins) / len(bins),
                                   "epoch_s": secs, "real_tokens_per_s": real / secs}
    s = out["strategies"]
    out["bfd_over_next_fit"] = {"rows": s["bfd"]["rows"] / s["next_fit"]["rows"],
                                "epoch_s": s["bfd"]["epoch_s"] / s["next_fit"]["epoch_s"],
                                "real_tokens_per_s": s["bfd"]["real_tokens_per_s"] / s["next_fit"]["real_tokens_per_s"]}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=("rows", "epoch"))
    ap.add_argument("--sessions", type=int, default=500)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--max_length", type=int, default=262144)
    ap.add_argument("--pick", default="bfd:10,next_fit:50,bfd:75",
                    help="rows: strategy:percentile of attention work, the first also the warm-up")
    ap.add_argument("--rows", default=None, help="epoch: the rows file that `rows` wrote")
    ap.add_argument("--measured", default=None, help="epoch: packed_step.py's packed_step.json")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows_cmd(a) if a.cmd == "rows" else epoch_cmd(a)


if __name__ == "__main__":
    main()
