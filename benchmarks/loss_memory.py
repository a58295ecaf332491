"""Peak memory of the loss alone (lm_head + cross-entropy, forward + backward): chunked vs plain.

    python benchmarks/loss_memory.py --out results.json             # CUDA if present, else CPU
    python benchmarks/loss_memory.py --device cpu --rows 2048        # a quick CPU check

GPU: torch.cuda.max_memory_allocated above what was allocated before the loss (bf16 by default).
CPU: the peak resident set size above the RSS before the loss (fp32 by default), each measurement in
a fresh process with the kernel's high-water mark reset, so one measurement cannot hide another.

Both methods end holding the same gradients (hidden and weight), reported as `grads_gib`;
`overhead_gib` = peak − grads is what the loss itself costs. Plain's overhead grows with rows × vocab
(its logits); chunked's is one chunk's logits plus an fp32 weight-gradient accumulator, so the second
point (a quarter of the rows) shows plain shrinking with rows × vocab and chunked barely moving.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ulysses_trainer.levers.chunked_loss import chunked_nll_sum, nll_sum  # noqa: E402
from ulysses_trainer.vocabulary.names import GIB  # noqa: E402


def _make_inputs(rows: int, vocab: int, hidden: int, dtype: torch.dtype, device: str):
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(rows, hidden, generator=g, device=device, dtype=dtype).requires_grad_(True)
    w = torch.empty(vocab, hidden, device=device, dtype=dtype)
    w.normal_(0.0, hidden ** -0.5, generator=g).requires_grad_(True)
    y = torch.randint(0, vocab, (rows,), generator=g, device=device)
    return h, w, y


def _loss_step(method: str, h, w, y, chunk_size: int) -> float:
    loss = chunked_nll_sum(h, w, y, chunk_size=chunk_size) if method == "chunked" else nll_sum(h, w, y)
    loss.backward()
    return loss.item()


def _grads_bytes(h, w) -> int:
    return h.grad.numel() * h.grad.element_size() + w.grad.numel() * w.grad.element_size()


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_rss_peak() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM); False where /proc does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cpu_worker(method, rows, vocab, hidden, dtype_name, chunk_size, queue) -> None:
    import gc

    h, w, y = _make_inputs(rows, vocab, hidden, getattr(torch, dtype_name), "cpu")
    gc.collect()
    exact = _reset_rss_peak()
    base_kib = _status_kib("VmRSS") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    loss = _loss_step(method, h, w, y, chunk_size)
    seconds = time.perf_counter() - t0
    peak_kib = _status_kib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    queue.put(dict(peak_bytes=(peak_kib - base_kib) * 1024, grads_bytes=_grads_bytes(h, w), loss=loss,
                   seconds=seconds, peak_source="VmHWM reset" if exact else "ru_maxrss (lower bound)"))


def measure_cpu(method, rows, vocab, hidden, dtype, chunk_size) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_cpu_worker, args=(method, rows, vocab, hidden, str(dtype).split(".")[-1],
                                              chunk_size, queue))
    p.start()
    p.join()
    if p.exitcode != 0:  # e.g. killed for memory: record it, keep the other measurements
        return dict(error=f"worker exited with code {p.exitcode}")
    return queue.get()


def measure_cuda(method, rows, vocab, hidden, dtype, chunk_size) -> dict:
    torch.cuda.empty_cache()
    h, w, y = _make_inputs(rows, vocab, hidden, dtype, "cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    try:
        loss = _loss_step(method, h, w, y, chunk_size)
    except torch.cuda.OutOfMemoryError as e:
        return dict(error=f"out of memory: {str(e).splitlines()[0]}")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    out = dict(peak_bytes=torch.cuda.max_memory_allocated() - base, grads_bytes=_grads_bytes(h, w),
               loss=loss, seconds=seconds, peak_source="torch.cuda.max_memory_allocated")
    del h, w, y
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--rows", type=int, default=None,
                    help="rows (tokens); default 16384 on CUDA, 8192 on CPU")
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--out", default="results.json")
    args = ap.parse_args(argv)

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    rows = args.rows or (16_384 if device == "cuda" else 8_192)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    measure = measure_cuda if device == "cuda" else measure_cpu
    if device == "cuda":  # cuBLAS workspaces and kernels load outside the measurement
        a = torch.randn(64, 64, device="cuda", dtype=dtype, requires_grad=True)
        _loss_step("chunked", a, a.detach().clone().requires_grad_(True),
                   torch.zeros(64, dtype=torch.long, device="cuda"), 16)

    points = [(rows, args.vocab), (max(1, rows // 4), args.vocab)]
    results = []
    for n, v in points:
        for method in ("plain", "chunked"):
            r = dict(method=method, rows=n, vocab=v, hidden=args.hidden,
                     logits_gib=n * v * dtype.itemsize / GIB)
            r.update(measure(method, n, v, args.hidden, dtype, args.chunk_size))
            if "peak_bytes" in r:
                r["peak_gib"] = r["peak_bytes"] / GIB
                r["grads_gib"] = r["grads_bytes"] / GIB
                r["overhead_gib"] = (r["peak_bytes"] - r["grads_bytes"]) / GIB
            results.append(r)
            shown = (f"peak {r['peak_gib']:7.2f} GiB  grads {r['grads_gib']:6.2f}  "
                     f"overhead {r['overhead_gib']:7.2f}  loss {r['loss']:.6g}  {r['seconds']:.1f}s"
                     if "peak_bytes" in r else r["error"])
            print(f"{method:8s} rows {n:6d} vocab {v:6d} (logits {r['logits_gib']:6.2f} GiB): {shown}",
                  flush=True)

    report = dict(device=device, dtype=str(dtype).split(".")[-1], hidden=args.hidden,
                  chunk_size=args.chunk_size, torch=torch.__version__,
                  gpu=torch.cuda.get_device_name() if device == "cuda" else None, results=results)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
