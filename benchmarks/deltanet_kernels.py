"""Qwen3.5's token mixers on one GPU, per rank of an SP group: Gated DeltaNet and head-dim-256 attention.

What it measures (results appended to OUT/deltanet_kernels.json as each case finishes):

- `exact`: fla's chunked gated delta rule (bf16, varlen over three packed documents, grouped values) against a
  float32 step-by-step recurrence, the rule as transformers' torch fallback writes it, one document at a time
  (the state starts at zero at every document) — output and every input's gradient, ‖Δ‖/‖ref‖.
- `delta_rule`: the chunked gated delta rule forward+backward at 128K-1M tokens for a rank's heads
  (Qwen3.5-27B at sp=8: 2 key / 6 value heads of 128; Qwen3.5-397B-A17B at sp=8: 2 / 8), time and peak memory.
- `conv`: fla's causal depthwise conv1d (kernel 4, silu) forward+backward on the same rank's channels.
- `attention_hd256`: causal attention, head dim 256 (27B at sp=8: 3 query heads, 1 KV head), SDPA's cuDNN
  backend and flash-attn-4 where installed, forward+backward, TFLOP/s with causal counted as half.
- `hf_layers` (only when named in --cases): four layers of transformers' Qwen3_5TextModel (3 DeltaNet + 1 full
  attention, default shape) forward+backward, naming the DeltaNet path it took; without the causal-conv1d package
  transformers takes its torch conv fallback, and on the H200 that ran past 520 s at 32K tokens.

    python benchmarks/deltanet_kernels.py OUT [--cases exact,delta_rule,conv,attention_hd256]

fla-core needs Triton >= 3.7.1 on Hopper (older Triton computes the gated backward wrongly, and fla refuses it);
benchmarks/offline/fla_parts.sh packs Triton 3.7.1 and fla-core for a machine without a registry.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F


def _record(out: Path, key: str, value: object) -> None:
    path = out / "deltanet_kernels.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    path.write_text(json.dumps(data, indent=1))
    print(key, json.dumps(value), flush=True)


def _timed(fn, reps: int = 3) -> tuple[float, float]:
    """Median seconds of `reps` calls after one warm-up, and the peak GiB over them."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], torch.cuda.max_memory_allocated() / 2**30


def reference_rule(q, k, v, g, beta, scale):
    """The gated delta rule step by step in float32 (transformers' torch_recurrent_gated_delta_rule).

    q, k: [T, H, K] (already l2-normalised), v: [T, HV, V], g (log decay), beta: [T, HV]; returns [T, HV, V].
    """
    hv = v.shape[1]
    q = q.float().repeat_interleave(hv // q.shape[1], dim=1) * scale  # [T, HV, K]
    k = k.float().repeat_interleave(hv // k.shape[1], dim=1)  # [T, HV, K]
    v, g, beta = v.float(), g.float(), beta.float()
    state = q.new_zeros(hv, q.shape[-1], v.shape[-1])  # [HV, K, V]
    outs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = (v[t] - (state * k[t][:, :, None]).sum(-2)) * beta[t][:, None]  # [HV, V]
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append((state * q[t][:, :, None]).sum(-2))
    return torch.stack(outs)  # [T, HV, V]


def _rule_inputs(t: int, h: int, hv: int, d: int, dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    q = F.normalize(r(1, t, h, d), dim=-1).to(dtype)
    k = F.normalize(r(1, t, h, d), dim=-1).to(dtype)
    v = r(1, t, hv, d).to(dtype)
    g = (-torch.exp(r(hv) * 0.5) * F.softplus(r(1, t, hv))).to(torch.float32)  # log decay ≤ 0, as Qwen3.5's gate
    beta = torch.sigmoid(r(1, t, hv)).to(dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def case_exact(out: Path) -> None:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    d, h, hv = 128, 2, 6
    bounds = [0, 1000, 2500, 4096]  # three packed documents, none a multiple of the chunk (64)
    q, k, v, g, beta = _rule_inputs(bounds[-1], h, hv, d, torch.bfloat16)
    cu = torch.tensor(bounds, device="cuda", dtype=torch.long)
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=d**-0.5, cu_seqlens=cu)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v, g, beta), do)
    ref_o, ref_grads = [], None
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v, g, beta)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        ref_o.append(reference_rule(*(x[0, a:b] for x in leaves), scale=d**-0.5))
    ref = torch.cat(ref_o)[None]
    ref_grads = torch.autograd.grad(ref, leaves, do.float())
    rel = lambda a, b: float((a.detach().float() - b.detach()).norm() / b.norm())
    res = {"output": rel(o, ref)}
    res.update({f"d{n}": rel(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta"), grads, ref_grads)})
    # the same documents one call each: varlen must equal separate runs (state reset at every boundary)
    sep = torch.cat(
        [chunk_gated_delta_rule(*(x[:, a:b] for x in (q, k, v, g, beta)), scale=d**-0.5)[0]
         for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
    res["varlen_vs_separate_max_abs"] = float((sep.float() - o.float()).abs().max())
    res["shape"] = {"tokens": bounds[-1], "documents": len(bounds) - 1, "key_heads": h, "value_heads": hv,
                    "head_dim": d, "dtype": "bfloat16 (reference float32)"}
    _record(out, "exact", res)


def case_delta_rule(out: Path, lengths: list[int]) -> None:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    rows = []
    for name, h, hv in (("qwen3.5-27b sp=8", 2, 6), ("qwen3.5-397b-a17b sp=8", 2, 8)):
        for t in lengths:
            if name.startswith("qwen3.5-397b") and t != lengths[-1]:
                continue
            q, k, v, g, beta = _rule_inputs(t, h, hv, 128, torch.bfloat16)
            do = torch.randn(1, t, hv, 128, device="cuda", dtype=torch.bfloat16)

            def fwd_bwd(q=q, k=k, v=v, g=g, beta=beta, do=do):
                o, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=128**-0.5)
                torch.autograd.grad(o, (q, k, v, g, beta), do)

            def fwd(q=q, k=k, v=v, g=g, beta=beta):
                with torch.no_grad():
                    chunk_gated_delta_rule(q, k, v, g, beta, scale=128**-0.5)

            s, peak = _timed(fwd_bwd)
            sf, _ = _timed(fwd)
            rows.append({"model": name, "tokens": t, "key_heads": h, "value_heads": hv, "fwd_bwd_s": s,
                         "fwd_s": sf, "peak_gib": peak, "tokens_per_s": t / s})
            print(rows[-1], flush=True)
            q = k = v = g = beta = do = fwd_bwd = fwd = None
            torch.cuda.empty_cache()
    _record(out, "delta_rule", rows)


def case_conv(out: Path, lengths: list[int]) -> None:
    from fla.modules.causal_conv1d import causal_conv1d

    rows = []
    dim = 2 * 2 * 128 + 6 * 128  # the rank's q, k (2 key heads) and v (6 value heads) channels, 27B at sp=8
    for t in lengths:
        x = torch.randn(1, t, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(dim, 4, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)

        def fwd_bwd(x=x, w=w, dy=dy):
            y, _ = causal_conv1d(x, w, activation="silu")
            torch.autograd.grad(y, (x, w), dy)

        s, peak = _timed(fwd_bwd)
        # against torch's conv1d (the fallback): the same output to bf16
        y, _ = causal_conv1d(x, w, activation="silu")
        ref = F.silu(F.conv1d(x.float().transpose(1, 2), w.float()[:, None], padding=3, groups=dim)[..., :t])
        err = float((y.float() - ref.transpose(1, 2)).norm() / ref.norm())
        rows.append({"tokens": t, "channels": dim, "fwd_bwd_s": s, "peak_gib": peak, "rel_err_vs_torch": err})
        print(rows[-1], flush=True)
        x = w = dy = y = ref = fwd_bwd = None
        torch.cuda.empty_cache()
    _record(out, "conv", rows)


def case_attention(out: Path, lengths: list[int]) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    hq, hkv, d = 3, 1, 256
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception as exc:  # noqa: BLE001 — optional kernel
        flash_attn_func = None
        rows.append({"flash_attn_4": f"not importable: {type(exc).__name__}: {exc}"})
    for t in lengths:
        q = torch.randn(1, t, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, t, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, t, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn(1, t, hq, d, device="cuda", dtype=torch.bfloat16)
        flops = 4 * t * t * d * hq / 2 * 3.5  # fwd (2 matmuls) + bwd (5 matmuls) = 3.5x fwd, causal half

        def cudnn(q=q, k=k, v=v, do=do):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True, enable_gqa=True)
            torch.autograd.grad(o, (q, k, v), do.transpose(1, 2))

        def fa4(q=q, k=k, v=v, do=do):
            o = flash_attn_func(q, k, v, causal=True)
            o = o[0] if isinstance(o, tuple) else o
            torch.autograd.grad(o, (q, k, v), do)

        for name, fn in (("sdpa_cudnn", cudnn), ("flash_attn_4", fa4 if flash_attn_func else None)):
            if fn is None:
                continue
            try:
                s, peak = _timed(fn, reps=2)
                rows.append({"kernel": name, "tokens": t, "q_heads": hq, "kv_heads": hkv, "head_dim": d,
                             "fwd_bwd_s": s, "tflops": flops / s / 1e12, "peak_gib": peak})
            except Exception as exc:  # noqa: BLE001 — record why a kernel cannot run this shape
                rows.append({"kernel": name, "tokens": t, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            print(rows[-1], flush=True)
        if flash_attn_func is not None and t == lengths[0]:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                     is_causal=True, enable_gqa=True).transpose(1, 2)
            try:
                o = flash_attn_func(q, k, v, causal=True)
                o = o[0] if isinstance(o, tuple) else o
                diff = (o.detach().float() - ref.detach().float()).abs().max()
                rows.append({"fa4_vs_cudnn_max_abs": float(diff), "tokens": t})
            except Exception as exc:  # noqa: BLE001
                rows.append({"fa4_vs_cudnn": f"{type(exc).__name__}: {str(exc)[:300]}"})
        q = k = v = do = cudnn = fa4 = o = ref = None
        torch.cuda.empty_cache()
    _record(out, "attention_hd256", rows)


def case_hf_layers(out: Path, lengths: list[int]) -> None:
    import transformers
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mod

    cfg = Qwen3_5TextConfig(num_hidden_layers=4, vocab_size=1024)
    cfg._attn_implementation = "sdpa"
    model = mod.Qwen3_5TextModel(cfg).cuda().to(torch.bfloat16)
    layer = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    path = {n: getattr(getattr(layer, n, None), "__module__", None)
            for n in ("chunk_gated_delta_rule", "causal_conv1d_fn", "norm")}
    rows = [{"transformers": transformers.__version__, "deltanet_path": path}]
    for t in lengths:
        try:
            x = torch.randn(1, t, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)

            def fwd_bwd(x=x):
                y = model(inputs_embeds=x).last_hidden_state
                y.float().pow(2).mean().backward()

            s, peak = _timed(fwd_bwd, reps=2)
            rows.append({"tokens": t, "fwd_bwd_s": s, "peak_gib": peak})
        except Exception as exc:  # noqa: BLE001 — an OOM at the longer length is a result
            rows.append({"tokens": t, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
        print(rows[-1], flush=True)
        x = None
        torch.cuda.empty_cache()
    _record(out, "hf_layers", rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--cases", default="exact,delta_rule,conv,attention_hd256")
    ap.add_argument("--lengths", default="131072,262144,524288,1048576")
    ap.add_argument("--attention_lengths", default="262144,1048576")
    ap.add_argument("--hf_lengths", default="32768,131072")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name()}
    try:
        import fla

        env["fla"] = fla.__version__
    except Exception as exc:  # noqa: BLE001
        env["fla"] = f"not importable: {exc}"
    _record(a.out, "env", env)
    ints = lambda s: [int(x) for x in s.split(",") if x]
    cases = {
        "exact": lambda: case_exact(a.out),
        "delta_rule": lambda: case_delta_rule(a.out, ints(a.lengths)),
        "conv": lambda: case_conv(a.out, ints(a.lengths)),
        "attention_hd256": lambda: case_attention(a.out, ints(a.attention_lengths)),
        "hf_layers": lambda: case_hf_layers(a.out, ints(a.hf_lengths)),
    }
    failed = 0
    for name in a.cases.split(","):
        try:
            cases[name]()
        except Exception:  # noqa: BLE001 — one case failing must not hide the others' numbers
            failed += 1
            _record(a.out, f"{name}_error", traceback.format_exc()[-2000:])
        torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
