"""Peak GPU memory vs sequence length per system, from benchmarks/results/*.json -> PNG + markdown table.

    python benchmarks/plot_results.py   # writes benchmarks/results/peak_memory_vs_length.png, prints the table
"""

from __future__ import annotations

import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def rows() -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(HERE, "*.json"))):
        data = json.load(open(path))
        if "points" not in data or "system" not in data:
            continue
        mode = data.get("settings", {}).get("mode", "train")  # planner probes ran full ZeRO-3 + AdamW steps
        for p in data["points"]:
            peak = p.get("peak_gpu_gb")
            if p.get("step_peaks_gb"):
                peak = max(p["step_peaks_gb"])
            tps = p.get("tokens_per_s")
            if tps is None and p["status"] == "ok" and p.get("attention") != "standin_memory_only" and p.get("step_s"):
                tps = p["seq_len"] / p["step_s"]
            out.append({"system": data["system"], "mode": mode, "variant": _variant(data["system"], p),
                        "seq_len": p["seq_len"], "status": p["status"],
                        "attention": p.get("attention"), "peak_gpu_gb": peak, "host_gb": p.get("peak_host_rss_gb"),
                        "step_s": p.get("step_s"), "tokens_per_s": tps,
                        "offloaded": p.get("offloaded_layers"), "opt_offload": bool(p.get("offload_optimizer")),
                        "file": os.path.basename(path)})
    return out


def _variant(system: str, p: dict) -> str:
    """Which settings a point of ours measured: HF's norms with attention over all heads at once, lean norms
    with one KV-head group at a time, or the latter also keeping attention outputs for the recompute."""
    if system != "ours":
        return ""
    if p.get("kept_attention_layers"):
        return "kept attention outputs"
    return "grouped attention, lean norms" if p.get("grouped_attention") else "HF norms, all-heads attention"


def plot(data: list[dict], path: str) -> None:
    fig, ax = plt.subplots(figsize=(12, 5.5))
    styles = {"ours": "tab:green", "alst": "tab:orange", "hf": "tab:blue"}
    markers = {"": "o", "HF norms, all-heads attention": "o", "grouped attention, lean norms": "s",
               "kept attention outputs": "^"}
    for (system, mode, variant) in sorted({(r["system"], r["mode"], r["variant"]) for r in data}):
        pts = sorted((r for r in data if (r["system"], r["mode"], r["variant"]) == (system, mode, variant)
                      and r["status"] == "ok"), key=lambda r: r["seq_len"])
        if not pts:
            continue
        xs, ys = [r["seq_len"] for r in pts], [r["peak_gpu_gb"] for r in pts]
        label = f"{system} ({'ZeRO-3 + AdamW step' if mode == 'train' else 'fwd+bwd only'}" + \
            (f", {variant})" if variant else ")")
        ax.plot(xs, ys, marker=markers.get(variant, "o"), color=styles.get(system),
                ls="-" if mode == "train" else "--", label=label)
        for r in pts:
            if r["attention"] == "standin_memory_only":
                text = "stand-in" + (", Adam on host" if r["opt_offload"] else "")
                ax.annotate(text, (r["seq_len"], r["peak_gpu_gb"]), fontsize=7, xytext=(4, -10),
                            textcoords="offset points")
        for r in (r for r in data if (r["system"], r["mode"], r["variant"]) == (system, mode, variant)
                  and r["status"] == "oom"):
            ax.scatter([r["seq_len"]], [140], marker="x", color=styles.get(system))
    ax.axhline(139.8, color="grey", lw=0.8, ls=":")
    ax.text(2**15, 136, "H200 capacity (x = OOM)", fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens, one sequence)")
    ax.set_ylabel("peak GPU memory allocated (GiB)")
    ax.set_title("Qwen3-4B, one H200, bf16, ZeRO-3")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(data: list[dict]) -> str:
    lines = ["| system | mode | length | attention | status | peak GPU GiB | host RSS GiB | step s | tokens/s "
             "| offloaded layers |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(data, key=lambda r: (r["mode"], r["system"], r["seq_len"])):
        f = lambda v, n=1: "–" if v is None else f"{v:.{n}f}"  # noqa: E731
        lines.append(f"| {r['system']} | {r['mode']} | {r['seq_len']:,} | {r['attention']} | {r['status']} | "
                     f"{f(r['peak_gpu_gb'])} | {f(r['host_gb'])} | {f(r['step_s'])} | {f(r['tokens_per_s'], 0)} | "
                     f"{'–' if r['offloaded'] is None else r['offloaded']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    d = rows()
    plot(d, os.path.join(HERE, "peak_memory_vs_length.png"))
    print(table(d))
