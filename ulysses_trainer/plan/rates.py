"""The measured rates the step-time model reads (plan/step_time.py), each with the benchmark file it comes from,
and the readers that rebuild the tables from benchmarks/results/ (tests tie each table to its files).

Torch-free. One H200: attention kernels by length, the dense rate, the optimizer, the RMSNorm kernels, a sparse
block by experts implementation and tile count, and a sparse model's once-per-step loss.
"""

from __future__ import annotations

import json
from pathlib import Path

# kernel -> ((length, forward TFLOP/s, backward TFLOP/s), ...): H200, 32 query / 8 KV heads of 128
KERNEL_RATES: dict[str, tuple[tuple[int, float, float], ...]] = {
    # attention_kernels_h200.json, "sdpa_cudnn" (ours runs cuDNN per KV group: same rate, the _fa4 file); 1M:
    # data_dependence_h200.json, "ours_grouped_cudnn" on random data (4 query heads / 1 KV head: sp=8 of 32/8)
    "sdpa": ((32768, 618.57, 521.87), (65536, 550.4, 536.3), (131072, 554.3, 531.1), (262144, 511.3, 534.36),
             (1048576, 496.95, 533.95)),
    # attention_kernels_h200_fa4.json, "ours_grouped_fa4"; 1M: data_dependence_h200.json, random data; 256K and
    # 1M with the trainer's tiles' gain (FA4_TUNED_SOURCES)
    "flash_attention_4": ((131072, 673.32, 614.2), (262144, 685.17, 620.0), (1048576, 677.96, 613.61)),
    # not measured: torch's flash kernel (FA2-based, attention_kernels_h200.json "sdpa_flash_expanded_kv")
    "flash_attention_2": ((32768, 339.46, 318.84), (65536, 324.57, 325.7), (131072, 318.11, 325.13),
                          (262144, 309.29, 325.77)),
}
# kernel -> the (file, row) pairs its points come from; data_dependence's rows: the random-data ones (on zeros the
# kernels run 20-27% faster, which no real step sees)
KERNEL_SOURCES = {"sdpa": (("attention_kernels_h200.json", "sdpa_cudnn"),
                           ("data_dependence_h200.json", "ours_grouped_cudnn")),
                  "flash_attention_4": (("attention_kernels_h200_fa4.json", "ours_grouped_fa4"),
                                        ("data_dependence_h200.json", "ours_grouped_fa4")),
                  "flash_attention_2": (("attention_kernels_h200.json", "sdpa_flash_expanded_kv"),)}
# the trainer's flash-attn-4 tiles on Hopper (attention/grouped.py FA4_SM90_*) against the library's defaults, one
# H200, the same process, 4 query heads over one KV head, random data: each file's "trainer" row over its "library"
# row, forward and backward, applied to the points above at the file's length (the points were measured on the
# library's tiles; at 131,072 no such pair was measured, and the library's rate is kept there)
FA4_TUNED_SOURCES = ("fa4_tuned_h200_256k.json", "fa4_tuned_h200_1m.json")
MEASURED_HEAD_SHAPE = (32, 8, 128)  # heads, KV heads, head_dim of the kernel benchmarks
DENSE_TFLOPS = 376.0  # effective rate of everything but attention (fitted, see the module docstring)
CPU_ADAM_S_PER_PARAM = 1.77e-9  # ZeRO-Offload step on the H200 host, per parameter updated by one rank
CPU_ADAM_MEASURED_CORES = 16  # the host's cores that rank had (the one-H200 machine): the rate scales by cores
GPU_ADAM_BYTES_PER_PARAM = 32  # fused Adam reads/writes weight, grad, m, v (fp32 master): memory-bound
GPU_BANDWIDTH = 4.0e12  # bytes/s (H200 HBM3e ~4.8 TB/s peak)
CALIBRATED_GPUS = ("H200",)
# norm_kernels_h200.json: seconds per normed element (forward, backward) by kernel and row width (a tie test
# rebuilds it from the file): "hidden" rows (input/post-attention/final norm), "head" rows (q/k norms)
NORM_S_PER_ELEMENT: dict[str, dict[str, tuple[float, float]]] = {
    "torch": {"hidden": (1.2392e-11, 4.1904e-11), "head": (1.333e-11, 4.8728e-11)},
    "triton": {"hidden": (1.145e-12, 3.841e-12), "head": (1.073e-12, 6.496e-12)},
}
NORM_SOURCE = "norm_kernels_h200.json"
# rope/rope_kernels_h200_to_512k.json: seconds per rotated element of q and k (forward, backward), HF's rotate_half
# ops ("torch") and levers/rope's one-pass Triton kernel, Qwen3-4B's 32 / 8 heads of 128 at 131K-524K tokens (the
# points' mean; a tie test rebuilds it from the file)
ROPE_S_PER_ELEMENT: dict[str, tuple[float, float]] = {"torch": (1.2815e-11, 1.7324e-11),
                                                      "triton": (1.2512e-12, 1.5035e-12)}
ROPE_SOURCE = "rope/rope_kernels_h200_to_512k.json"
# A sparse block (router, routing, permutation, experts), by transformers' experts_implementation and tile count:
# (tiles, active TFLOP/s) of one Qwen3-30B-A3B block, 131,072 rows, bf16, forward + backward, one H200,
# transformers 5.17 (moe/moe_experts_h200.json; active FLOPs 6 x rows x top_k x 3 x H x I; batched_mm ran out
# of memory at every tile count and is not planned). Re-measure: benchmarks/suite.py moe_experts.
EXPERTS_TFLOPS: dict[str, tuple[tuple[int, float], ...]] = {
    "eager": ((1, 79.83), (4, 26.35), (8, 13.45)),
    "grouped_mm": ((1, 217.37), (4, 158.15), (8, 150.62)),
}
EXPERTS_SOURCE = "moe/moe_experts_h200.json"
EXPERTS_MEASURED_ROWS = 131072
# A sparse model's once-per-step part (embedding, final norm, chunked lm_head + loss), from the 1- and 8-layer
# profiles of Qwen3-4B at 262,144 tokens (the 1-layer run's kernel time minus one layer's share of the
# difference): the lm_head's 6 V H t FLOPs at the matmuls' measured rate, everything else per logit (t x V).
# A dense model keeps its lm_head inside DENSE_TFLOPS, which was fitted with it.
LOSS_SOURCES = ("profile_262144_l1_offtrue_tiledauto_fixed.json", "profile_262144_l8_offtrue_tiledauto_fixed.json")
LOSS_MATMUL_TFLOPS = 775.9
LOSS_S_PER_LOGIT = 2.6794e-11
# Gated DeltaNet (Qwen3.5), one H200, bf16, fla-core 0.6.0 (deltanet_kernels/h200.json): the chunked rule's
# forward and forward+backward seconds and its fwd+bwd peak bytes, per token and value head of 128 x 128 (the
# 1,048,576-token row of Qwen3.5-27B's heads at sp=8: 2 key / 6 value heads); the causal conv's fwd+bwd seconds
# per token and channel (fla's conv, 1,280 channels, 1M tokens; deltanet_kernel fla runs both). The torch
# kernel's rule and conv (families/qwen3_5/deltanet_kernels.py) are not measured: they are planned at these rates
# (the plan says so).
DELTANET_SOURCE = "deltanet_kernels/h200.json"
DELTANET_RULE_S = (4.5796e-09, 1.6679e-08)  # (forward, forward + backward) s per token and value head
DELTANET_RULE_PEAK_BYTES = 4158.7  # fwd+bwd peak per token and value head
DELTANET_CONV_S = 8.9255e-12  # fwd+bwd s per token and channel

# The full-attention kernels at head_dim 256 (Qwen3.5's full layers), one H200, causal, bf16, forward+backward
# TFLOP/s by length, 3 query heads over one KV head (the 27B's share at sp=8), deltanet_kernels/h200.json
# "attention_hd256": 60-75% of the head-dim-128 rates above; the step model scales the 128 points by the ratio
# at the same length (only fwd+bwd was measured at 256, so forward and backward scale alike).
HD256_RATES: dict[str, tuple[tuple[int, float], ...]] = {
    "sdpa": ((262144, 402.87), (1048576, 405.73)),
    "flash_attention_4": ((262144, 432.8), (1048576, 425.76)),
}
HD256_KERNELS = {"sdpa": "sdpa_cudnn", "flash_attention_4": "flash_attn_4"}  # the file's names


def norm_rates_from_results(results_dir: str | Path,
                            source: str = NORM_SOURCE) -> dict[str, dict[str, tuple[float, float]]]:
    """NORM_S_PER_ELEMENT rebuilt from the benchmark file: per kernel, the mean seconds per element of the
    hidden-width points and of the head-width (128) points (a test ties the table to it)."""
    points = json.loads((Path(results_dir) / source).read_text())["points"]
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for kernel in ("torch", "triton"):
        rows = {"hidden": [p for p in points if p["kernel"] == kernel and p["width"] > 128],
                "head": [p for p in points if p["kernel"] == kernel and p["width"] == 128]}
        out[kernel] = {k: (round(sum(p["fwd_ns_per_element"] for p in v) / len(v) * 1e-9, 15),
                           round(sum(p["bwd_ns_per_element"] for p in v) / len(v) * 1e-9, 15))
                       for k, v in rows.items()}
    return out


def rope_rates_from_results(results_dir: str | Path, source: str = ROPE_SOURCE) -> dict[str, tuple[float, float]]:
    """ROPE_S_PER_ELEMENT rebuilt from the benchmark file: per kernel, the mean over its points of the forward and
    backward seconds per element of q and k (a test ties the table to it)."""
    points = json.loads((Path(results_dir) / source).read_text())["points"]
    out = {}
    for kernel, key in (("torch", "rotate_half"), ("triton", "triton")):
        per = [[p[key][f"{d}_s"] / (p["tokens"] * (p["heads"][0] + p["heads"][1]) * p["heads"][2]) for p in points]
               for d in ("fwd", "bwd")]
        out[kernel] = tuple(float(f"{sum(v) / len(v):.5g}") for v in per)
    return out


def kernel_rates_from_results(results_dir: str | Path, sources_by_kernel: dict | None = None,
                              tuned: tuple[str, ...] = FA4_TUNED_SOURCES,
                              ) -> dict[str, tuple[tuple[int, float, float], ...]]:
    """KERNEL_RATES rebuilt from the benchmark files (a test ties the table to them). `tuned`: the files of the
    trainer's flash-attn-4 tiles' gain over the library's, applied to points measured on the library's tiles
    (none where the points ran the trainer's own calls)."""
    out = {}
    for kernel, sources in (KERNEL_SOURCES if sources_by_kernel is None else sources_by_kernel).items():
        pts = []
        for name, row in sources:
            data = json.loads((Path(results_dir) / name).read_text())
            pts += [(p["seq_len"], p["fwd_tflops"], 2.5 * p["fwd_tflops"] * p["fwd_s"] / p["bwd_s"])
                    for p in data["points"] if p["kernel"] == row and p.get("data", "random") == "random"]
        if kernel == "flash_attention_4" and tuned:
            gain = fa4_tile_gains(results_dir, tuned)
            pts = [(n, f * gain.get(n, (1.0, 1.0))[0], b * gain.get(n, (1.0, 1.0))[1]) for n, f, b in pts]
        out[kernel] = tuple((n, round(f, 2), round(b, 2)) for n, f, b in sorted(pts))
    return out


def fa4_tile_gains(results_dir: str | Path,
                   sources: tuple[str, ...] = FA4_TUNED_SOURCES) -> dict[int, tuple[float, float]]:
    """length -> (forward, backward) speed-up of the trainer's flash-attn-4 tiles over the library's, from
    FA4_TUNED_SOURCES (library time over trainer time: > 1 is faster)."""
    out = {}
    for name in sources:
        rows = {r["variant"]: r for r in json.loads((Path(results_dir) / name).read_text())["rows"]}
        lib, ours = rows["library"], rows["trainer"]
        out[ours["seq_len"]] = (lib["fwd_s"] / ours["fwd_s"], lib["bwd_s"] / ours["bwd_s"])
    return out


def experts_rates_from_results(results_dir: str | Path,
                               source: str = EXPERTS_SOURCE) -> dict[str, tuple[tuple[int, float], ...]]:
    """EXPERTS_TFLOPS rebuilt from the benchmark file: per implementation, its timed (tiles, active TFLOP/s) rows
    (those that ran out of memory have no rate and are left out; a test ties the table to it)."""
    rows = json.loads((Path(results_dir) / source).read_text())["rows"]
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if "active_tflops" in r:
            out.setdefault(r["experts_implementation"], []).append((r["tiles"], round(r["active_tflops"], 2)))
    return {k: tuple(sorted(v)) for k, v in out.items()}


def loss_rates_from_results(results_dir: str | Path, sources: tuple[str, str] = LOSS_SOURCES
                            ) -> tuple[float, float]:
    """(LOSS_MATMUL_TFLOPS, LOSS_S_PER_LOGIT) rebuilt from the 1- and 8-layer profiles: the once-per-step kernel
    time is the 1-layer run's minus one layer's (the runs' difference / 7); its matmuls are the lm_head's
    6 V H t FLOPs, the rest (elementwise, reductions, copies) is divided by the t x V logits."""
    one, eight = (json.loads((Path(results_dir) / n).read_text()) for n in sources)
    assert one["model"] == eight["model"] == "qwen3-4b" and one["length"] == eight["length"]
    per = eight["layers"] - one["layers"]

    def fixed(bucket: str) -> float:
        a, b = one["seconds_by_bucket"].get(bucket, 0.0), eight["seconds_by_bucket"].get(bucket, 0.0)
        return a - (b - a) / per * one["layers"]

    vocab, hidden, t = 151936, 2560, one["length"]  # Qwen3-4B
    rest = sum(fixed(b) for b in one["seconds_by_bucket"] if b != "matmul" and not b.startswith("attention"))
    return round(6.0 * vocab * hidden * t / fixed("matmul") / 1e12, 1), float(f"{rest / (t * vocab):.5g}")


def _outside_attention_s(profile: dict) -> float:
    """A profile's kernel seconds outside attention: matmuls, elementwise, reductions, copies."""
    return sum(s for b, s in profile["seconds_by_bucket"].items() if not b.startswith("attention"))


def dense_rate_from_results(results_dir: str | Path, sources: tuple[str, str]) -> float:
    """A card's DENSE_TFLOPS from the H200's: the 8-layer profile of LOSS_SOURCES run on both cards, the H200's
    rate scaled by how much faster the card ran its kernels outside attention (the FLOPs are the same run's)."""
    h200, card = (json.loads((Path(results_dir) / n).read_text()) for n in (LOSS_SOURCES[1], sources[1]))
    assert (h200["model"], h200["length"], h200["layers"]) == (card["model"], card["length"], card["layers"])
    return round(DENSE_TFLOPS * _outside_attention_s(h200) / _outside_attention_s(card), 1)


def deltanet_rule_rates_from_results(results_dir: str | Path,
                                     source: str = DELTANET_SOURCE) -> tuple[tuple[float, float], float]:
    """(DELTANET_RULE_S, DELTANET_RULE_PEAK_BYTES) rebuilt from a benchmark file: its longest Qwen3.5-27B rule row."""
    data = json.loads((Path(results_dir) / source).read_text())
    rule = max((r for r in data["delta_rule"] if r["model"].startswith("qwen3.5-27b")), key=lambda r: r["tokens"])
    n = rule["tokens"] * rule["value_heads"]
    return (float(f"{rule['fwd_s'] / n:.5g}"), float(f"{rule['fwd_bwd_s'] / n:.5g}")), round(
        rule["peak_gib"] * 2**30 / n, 1)


def deltanet_conv_rate_from_results(results_dir: str | Path, source: str = DELTANET_SOURCE) -> float:
    """DELTANET_CONV_S rebuilt from a benchmark file: its longest conv row, seconds per token and channel."""
    conv = max(json.loads((Path(results_dir) / source).read_text())["conv"], key=lambda r: r["tokens"])
    return float(f"{conv['fwd_bwd_s'] / (conv['tokens'] * conv['channels']):.5g}")


def deltanet_rates_from_results(results_dir: str | Path) -> tuple[tuple[float, float], float, float]:
    """(DELTANET_RULE_S, DELTANET_RULE_PEAK_BYTES, DELTANET_CONV_S) rebuilt from the benchmark file: its longest
    Qwen3.5-27B rule row and its longest conv row (a test ties the table to it)."""
    return (*deltanet_rule_rates_from_results(results_dir), deltanet_conv_rate_from_results(results_dir))


def cpu_adam_rates_from_results(results_dir: str | Path, source: str) -> tuple[tuple[int, float], ...]:
    """A card's CPU Adam table rebuilt from benchmarks/cpu_adam.py's file: (cores, seconds per parameter) by cores."""
    rows = json.loads((Path(results_dir) / source).read_text())["rows"]
    return tuple((r["cores"], float(f"{r['s_per_param']:.4g}")) for r in sorted(rows, key=lambda r: r["cores"]))


def hd256_rates_from_results(results_dir: str | Path, source: str = DELTANET_SOURCE,
                             kernels: dict[str, str] = HD256_KERNELS) -> dict[str, tuple[tuple[int, float], ...]]:
    """HD256_RATES rebuilt from the benchmark file (a test ties the table to it): deltanet_kernels' attention_hd256
    rows (tokens, tflops), or attention_kernels.py's points (seq_len, fwd_bwd_tflops)."""
    data = json.loads((Path(results_dir) / source).read_text())
    rows = data["attention_hd256"] if "attention_hd256" in data else [
        {"kernel": p["kernel"], "tokens": p["seq_len"], "tflops": p["fwd_bwd_tflops"]} for p in data["points"]]
    return {k: tuple((r["tokens"], round(r["tflops"], 2)) for r in rows if r.get("kernel") == name)
            for k, name in kernels.items()}


def _sink_width(head_dim: int) -> int:
    """attention/kernels._sink_document's width: head_dim + the sink column, padded to a multiple of 8."""
    return -(-(head_dim + 1) // 8) * 8


def sink_rates_from_results(results_dir: str | Path, sources: tuple[str, ...]
                            ) -> dict[str, tuple[tuple[int, float, float], ...]]:
    """Sink attention's full layers by kernel, (tokens, forward, backward TFLOP/s) rebuilt from
    benchmarks/sink_attention.py's files: FLOPs counted at the model's head_dim (2 L^2 heads d forward, backward 2.5x),
    though the kernel runs the widened head; the first file's point wins where two measured one length."""
    points: dict[str, dict[int, tuple[float, float]]] = {}
    for source in sources:
        data = json.loads((Path(results_dir) / source).read_text())
        heads, dim = data["shape"]["heads"], data["shape"]["head_dim"]
        for r in data["rows"]:
            if not r["case"].startswith("full, ") or "error" in r:
                continue
            flops = 2.0 * r["tokens"] ** 2 * heads * dim
            rate = (round(flops / r["fwd_s"] / 1e12, 2), round(2.5 * flops / (r["fwd_bwd_s"] - r["fwd_s"]) / 1e12, 2))
            points.setdefault(r["case"][len("full, "):], {}).setdefault(r["tokens"], rate)
    return {k: tuple((n, *v[n]) for n in sorted(v)) for k, v in sorted(points.items())}


def window_block_rates_from_results(results_dir: str | Path, source: str) -> tuple[int, float, float]:
    """The sliding layers' batched block path (attention/windowed.py), (window, forward, backward TFLOP/s) at the
    file's longest row: FLOPs as the path computes them, 4 x tokens x heads x keys x width (keys: 2 x window, + 1 sink;
    the width the sink widens the head to), backward 2.5x."""
    data = json.loads((Path(results_dir) / source).read_text())
    heads, dim = data["shape"]["heads"], data["shape"]["head_dim"]
    r = max((r for r in data["rows"] if r["case"] == "sliding, blocks batched"), key=lambda r: r["tokens"])
    flops = 4.0 * r["tokens"] * heads * (2 * r["window"] + 1) * _sink_width(dim)
    return r["window"], round(flops / r["fwd_s"] / 1e12, 2), round(2.5 * flops / (r["fwd_bwd_s"] - r["fwd_s"]) / 1e12,
                                                                     2)


def mixer_rate_from_results(results_dir: str | Path, source: str) -> float:
    """A whole DeltaNet mixer's forward+backward seconds per local token (benchmarks/qwen3_5_mixer.py's file: its
    longest one-document fla row, one rank's heads at the file's sp over tokens / sp local tokens)."""
    data = json.loads((Path(results_dir) / source).read_text())
    row = max((r for r in data["mixer"] if r["kernel"] == "fla" and not r["packed"] and "fwd_bwd_s" in r),
              key=lambda r: r["tokens"])
    return float(f"{row['fwd_bwd_s'] / (row['tokens'] / data['env']['sp_size']):.5g}")
