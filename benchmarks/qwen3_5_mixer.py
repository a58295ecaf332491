"""One rank's Gated DeltaNet mixer as the trainer runs it (families/qwen3_5/ulysses_deltanet.UlyssesGatedDeltaNet),
on one GPU.

What it measures (results appended to OUT/qwen3_5_mixer.json as each case finishes), bf16, forward + backward:

- `mixer`: the whole mixer of one rank at sp=8 without the all-to-alls (sp=1 on that rank's share of heads:
  Qwen3.5-27B's 2 key / 6 value heads of 128, hidden 5120, or `--model`'s at `--sp_size`, e.g. qwen3.5-35b-a3b:
  2 / 4 heads, hidden 2048; its lean gated norm), at each length, one document and
  three packed documents, for every installed deltanet_kernel: forward+backward seconds and peak GiB above the
  input.
- `conv`: the trainer's causal conv (families/qwen3_5/deltanet_kernels.causal_conv) against fla's causal_conv1d where
  installed, on the same rank's 1,280 channels: seconds, and their outputs' relative difference.
- `agree`: the mixer with fla against the mixer with the torch rule on the same weights and packed input (output
  and input-gradient relative differences), where fla is installed.

    python benchmarks/qwen3_5_mixer.py OUT [--lengths 131072,262144,1048576] [--model qwen3.5-35b-a3b] [--kernels fla]

These are the rates plan/rates.py would take for the trainer's own conv and the torch rule (planned today at fla's
measured ones, benchmarks/results/deltanet_kernels/h200.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _record(out: Path, key: str, value: object) -> None:
    """`env` is one dict; every other case a list of rows."""
    path = out / "qwen3_5_mixer.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    if key == "env":
        data[key] = value
    else:
        data.setdefault(key, []).append(value)
    path.write_text(json.dumps(data, indent=1))
    print(key, json.dumps(value), flush=True)


# (preset, sp size) whose one rank's mixer is timed: --model, --sp_size
MODEL = ["qwen3.5-27b", 8]


def _hidden() -> int:
    from ulysses_trainer.families.presets import preset_config

    return preset_config(MODEL[0]).hidden_size


def _mixer(kernel: str, seed: int = 0):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.families.qwen3_5.lean_gated_norm import use_lean_gated_norms
    from ulysses_trainer.families.qwen3_5.ulysses_deltanet import UlyssesGatedDeltaNet
    from ulysses_trainer.parallel.state import single_process_state

    c = preset_config(MODEL[0])
    sp = MODEL[1]  # one rank's share of the heads at this sp (27B at sp=8: 2 key / 6 value heads)
    c.linear_num_key_heads, c.linear_num_value_heads = c.linear_num_key_heads // sp, c.linear_num_value_heads // sp
    torch.manual_seed(seed)
    net = Qwen3_5GatedDeltaNet(c, 0).to("cuda", torch.bfloat16)
    mixer = UlyssesGatedDeltaNet(net, single_process_state(), kernel)
    use_lean_gated_norms(mixer)  # its gated norm as the trainer runs it (families/qwen3_5/lean_gated_norm.py)
    return mixer


def _cu(length: int, packed: bool) -> torch.Tensor | None:
    if not packed:
        return None
    a, b = length // 3, 2 * length // 3 + 17
    return torch.tensor([0, a, b, length], device="cuda", dtype=torch.int32)


def _context(length: int, cu: torch.Tensor | None):
    """The shard context the mixer reads: one row of `length` tokens, its documents at `cu` (None: one)."""
    from ulysses_trainer.parallel.sharding import ShardContext

    rows = ShardContext.for_rows(torch.zeros(1, length, dtype=torch.long, device="cuda"), sp_rank=0)
    return dataclasses.replace(rows, cu_seqlens=cu, packed=cu is not None)


def _timed(fn, reps: int = 3) -> tuple[float, float]:
    """Median seconds of `reps` calls after one warm-up, and the peak GiB allocated over them above the start."""
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], (torch.cuda.max_memory_allocated() - base) / 2**30


def case_mixer(out: Path, lengths: list[int], kernels: list[str] | None) -> None:
    from ulysses_trainer.families.qwen3_5.deltanet_kernels import available_deltanet_kernels

    for kernel in [k for k in available_deltanet_kernels() if kernels is None or k in kernels]:
        mixer = _mixer(kernel)
        for length in lengths:
            for packed in (False, True):
                x = torch.randn(1, length, _hidden(), device="cuda", dtype=torch.bfloat16, requires_grad=True)
                context = _context(length, _cu(length, packed))

                def step(x=x, context=context, mixer=mixer):
                    y = mixer(x, sp_context=context)
                    y.backward(torch.ones_like(y))
                    x.grad = None
                    for p in mixer.parameters():
                        p.grad = None

                try:
                    s, peak = _timed(step)
                    _record(out, "mixer", {"kernel": kernel, "tokens": length, "packed": packed,
                                           "fwd_bwd_s": s, "peak_gib": peak, "tokens_per_s": length / s})
                except torch.OutOfMemoryError as exc:
                    _record(out, "mixer", {"kernel": kernel, "tokens": length, "packed": packed,
                                           "error": f"out of memory: {str(exc).splitlines()[0]}"})
                x = None
                torch.cuda.empty_cache()


def case_conv(out: Path, lengths: list[int]) -> None:
    from ulysses_trainer.families.qwen3_5.deltanet_kernels import causal_conv

    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception:  # flash-linear-attention not installed
        causal_conv1d = None
    channels = 2 * 2 * 128 + 6 * 128
    for length in lengths:
        x = torch.randn(1, channels, length, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(channels, 4, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def ours(x=x, w=w):
            y = causal_conv(x, w, None)
            y.backward(torch.ones_like(y))

        row = {"tokens": length, "channels": channels}
        row["ours_fwd_bwd_s"], row["ours_peak_gib"] = _timed(ours)
        if causal_conv1d is not None:
            def fla(x=x, w=w):
                y, _ = causal_conv1d(x.transpose(1, 2), w, activation="silu")  # [B, T, C]
                y.backward(torch.ones_like(y))

            row["fla_fwd_bwd_s"], row["fla_peak_gib"] = _timed(fla)
            with torch.no_grad():
                a = causal_conv(x, w, None).float()
                b = causal_conv1d(x.transpose(1, 2), w, activation="silu")[0].transpose(1, 2).float()
                row["ours_vs_fla_rel"] = float((a - b).norm() / b.norm())
        _record(out, "conv", row)
        x = w = None
        torch.cuda.empty_cache()


def case_agree(out: Path) -> None:
    from ulysses_trainer.families.qwen3_5.deltanet_kernels import available_deltanet_kernels

    if "fla" not in available_deltanet_kernels():
        _record(out, "agree", {"skipped": "flash-linear-attention not installed (or Triton < 3.7.1 on Hopper)"})
        return
    length = 16384
    x = torch.randn(1, length, _hidden(), device="cuda", dtype=torch.bfloat16)
    cu = _cu(length, True)
    res = {}
    for kernel in ("fla", "torch"):
        mixer = _mixer(kernel, seed=1)
        xi = x.clone().requires_grad_()
        y = mixer(xi, sp_context=_context(length, cu))
        y.float().pow(2).mean().backward()
        res[kernel] = (y.detach().float(), xi.grad.float())
    rel = lambda a, b: float((a - b).norm() / b.norm())
    _record(out, "agree", {"tokens": length, "documents": 3, "output_rel": rel(res["fla"][0], res["torch"][0]),
                           "input_grad_rel": rel(res["fla"][1], res["torch"][1])})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--lengths", default="131072,262144,1048576")
    ap.add_argument("--cases", default="agree,conv,mixer")
    ap.add_argument("--model", default="qwen3.5-27b", help="the preset whose rank's mixer is timed (qwen3.5-35b-a3b)")
    ap.add_argument("--sp_size", type=int, default=8, help="the SP size whose share of the heads one rank holds")
    ap.add_argument("--kernels", default=None, help="the mixer case's deltanet kernels (default: every installed)")
    args = ap.parse_args()
    MODEL[:] = [args.model, args.sp_size]
    args.out.mkdir(parents=True, exist_ok=True)
    import transformers
    import triton

    _record(args.out, "env", {"torch": torch.__version__, "triton": triton.__version__, "model": args.model,
                              "sp_size": args.sp_size, "transformers": transformers.__version__,
                              "device": torch.cuda.get_device_name()})
    lengths = [int(n) for n in args.lengths.split(",")]
    cases = {"agree": lambda: case_agree(args.out), "conv": lambda: case_conv(args.out, lengths),
             "mixer": lambda: case_mixer(args.out, lengths, args.kernels and args.kernels.split(","))}
    for name in args.cases.split(","):
        try:
            cases[name]()
        except Exception:  # one case failing leaves the others' results
            traceback.print_exc()
            _record(args.out, name, {"error": traceback.format_exc().splitlines()[-1]})


if __name__ == "__main__":
    main()
