"""The benchmark entry point: named cases that reproduce the README's benchmark tables.

    python benchmarks/suite.py                          # list the cases
    python benchmarks/suite.py CASE [CASE ...] [--out DIR] [--dry-run]

Every case is a list of script calls (one H200; Qwen3-4B; flash-attn-4 installed for the `fa4` cases),
run one after another in fresh processes: DeepSpeed keeps parts of an engine alive, so train-mode lengths
each get their own. Each call writes the JSON file named like the committed one in benchmarks/results/
into DIR (default: $OUT, else bench_out/); `python benchmarks/plot_results.py` turns results into the
plot and table. `smoke` runs the same scripts on CPU with the tiny preset in about a minute.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

M = "qwen3-4b"
LC, KERNELS, PROFILE = "benchmarks/long_context.py", "benchmarks/attention_kernels.py", "benchmarks/profile_step.py"
WARM = ("--warmup-tokens", "8192")  # one untimed 8K step first: kernel compilation stays out of the timed step
FWDBWD = ("--mode", "fwdbwd")
KEPT_OFFLOADED = ("--keep-attention-outputs", "true", "--offload", "true")


def _lc(out: str, system: str, lengths: str, *extra: str) -> tuple[str, ...]:
    return (LC, "--system", system, "--model", M, "--lengths", lengths, *extra, "--out", out)


CASES: dict[str, tuple[str, list[tuple[str, ...]]]] = {
    "kernels": ("attention kernels alone, 32K-256K; ours one KV group at a time (cuDNN)", [
        (KERNELS, "--lengths", "32768,65536,131072,262144", "--iters", "2", "--out", "attention_kernels_h200.json"),
        ("benchmarks/kernel_api_probe.py", "--lengths", "131072", "--out", "kernel_api_probe.json")]),
    "kernels_fa4": ("attention kernels with flash-attn-4, 128K and 256K", [
        (KERNELS, "--lengths", "131072,262144", "--iters", "2", "--kernels",
         "sdpa_cudnn,ours_grouped_cudnn,flash_attention_4,ours_grouped_fa4",
         "--out", "attention_kernels_h200_fa4.json")]),
    "train": ("full ZeRO-3 + AdamW steps: hf and alst to their OOM, ours 32K-128K", [
        _lc("long_context_hf_qwen3-4b.json", "hf", "32768,65536"),
        _lc("long_context_alst_qwen3-4b_a.json", "alst", "32768,65536", "--offload", "true"),
        *(_lc(f"long_context_ours_train_qwen3-4b_{n}.json", "ours", str(n), "--steps", "2")
          for n in (32768, 65536, 131072))]),
    "train_1m": ("1,048,576 tokens, Adam on the host, 1 in 4 layer inputs kept, 7 offloaded, stand-in attention", [
        _lc("long_context_ours_train_qwen3-4b_1048576_standin_every4_off7.json", "ours", "1048576",
            "--standin-from", "1", "--checkpoint-every", "4", "--offload", "7", "--offload-optimizer")]),
    "fwdbwd": ("forward+backward: alst 128K/256K, ours 256K real and stand-in, ours keeping attention outputs", [
        _lc("long_context_alst_fwdbwd_qwen3-4b.json", "alst", "131072", *FWDBWD, "--offload", "true"),
        _lc("long_context_alst_fwdbwd_qwen3-4b_262144.json", "alst", "262144", *FWDBWD, "--offload", "true"),
        _lc("long_context_ours_fwdbwd_qwen3-4b_262144_grouped.json", "ours", "262144", *FWDBWD),
        _lc("long_context_ours_fwdbwd_qwen3-4b_262144_standin_grouped.json", "ours", "262144", *FWDBWD,
            "--standin-from", "1"),
        _lc("long_context_ours_fwdbwd_qwen3-4b_131072_kept_auto.json", "ours", "131072", *FWDBWD,
            "--keep-attention-outputs", "auto"),
        _lc("long_context_ours_fwdbwd_qwen3-4b_262144_kept.json", "ours", "262144", *FWDBWD, *KEPT_OFFLOADED)]),
    "fwdbwd_warm": ("forward+backward after an untimed 8K step, alst vs ours (cuDNN) in one session", [
        _lc("long_context_alst_fwdbwd_qwen3-4b_131072_warm.json", "alst", "131072", *FWDBWD, "--offload", "true",
            *WARM),
        _lc("long_context_alst_fwdbwd_qwen3-4b_262144_warm.json", "alst", "262144", *FWDBWD, "--offload", "true",
            *WARM),
        _lc("long_context_ours_fwdbwd_qwen3-4b_262144_kept_cudnn_warm.json", "ours", "262144", *FWDBWD,
            *KEPT_OFFLOADED, *WARM)]),
    "fwdbwd_fa4": ("forward+backward with flash-attn-4 after an untimed 8K step, 128K and 256K", [
        _lc("long_context_ours_fwdbwd_qwen3-4b_131072_kept_auto_fa4_warm.json", "ours", "131072", *FWDBWD,
            "--kernel", "flash_attention_4", "--keep-attention-outputs", "auto", "--offload", "true", *WARM),
        _lc("long_context_ours_fwdbwd_qwen3-4b_262144_kept_fa4_warm.json", "ours", "262144", *FWDBWD,
            "--kernel", "flash_attention_4", *KEPT_OFFLOADED, *WARM)]),
    "profile": ("where the 256K step's time goes: torch.profiler over 8 and 1 of 36 layers (per layer = diff / 7)", [
        (PROFILE, "--model", M, "--length", "262144", "--layers", str(n), *KEPT_OFFLOADED,
         "--out", f"profile_262144_l{n}_offtrue_tiledauto_fixed.json") for n in (8, 1)]),
    "smoke": ("CPU check of the scripts: tiny preset, 256 tokens", [
        (LC, "--system", "ours", "--model", "tiny", "--lengths", "256", *FWDBWD, "--out", "smoke_long_context.json"),
        (PROFILE, "--model", "tiny", "--length", "128", "--keep-attention-outputs", "true",
         "--out", "smoke_profile.json")]),
}


def commands(case: str, out_dir: str) -> list[list[str]]:
    """The calls of one case, with their --out inside out_dir."""
    calls = []
    for script, *args in CASES[case][1]:
        i = args.index("--out") + 1
        args[i] = os.path.join(out_dir, args[i])
        calls.append([sys.executable, script, *args])
    return calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", metavar="CASE")
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out", help="directory for the JSON results")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        print(f"error: unknown case {', '.join(unknown)}; pick from {', '.join(CASES)}", file=sys.stderr)
        return 2
    if not args.cases:
        for name, (what, _) in CASES.items():
            print(f"{name:12s} {what}")
        return 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    failed = 0
    for case in args.cases:
        for cmd in commands(case, os.path.abspath(args.out)):
            print("+", " ".join(cmd[1:]), flush=True)
            if not args.dry_run:
                os.makedirs(args.out, exist_ok=True)
                failed += subprocess.run(cmd, cwd=root).returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
