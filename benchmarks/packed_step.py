"""A packed row against the same tokens as one document, on one GPU: the attention kernels alone at the row's
length, then the real trainer's steps (step time, real tokens/s, peak memory against the plan), and a profile of
the one-document step (kernel buckets, the GPU's idle time, the trainer's forward / backward / optimizer phases).

    python benchmarks/packed_step.py --out DIR [--phases attention,train,profile] [--budget_s 540] \
        -- --config launch/recipes/one_gpu_4b_long.yaml [--name value ...]

The packed row: document lengths drawn from a heavy-tailed distribution (log-normal, median 60K tokens, sigma 1,
clipped to 4K-400K), filling the row exactly (the last document cut to the room left), over the one-document
row's own tokens with positions restarting at each document. Attention FLOPs scale as sum(l_i^2) against L^2.
Step 1 (one document) runs untimed (kernel compilation, pinned pools); then the packed step, then the
one-document step (under torch.profiler with `profile`). Results are written to DIR/packed_step.json after every
phase, so a run stopped by a time limit keeps what it measured; a phase that would overrun --budget_s is skipped.

`--phases rows --rows ROWS.json` times given packed rows instead (ROWS.json: {"name": [document lengths], ...},
each summing to at most max_length; the rest of a row is pads that continue the last document's positions, as the
data pipeline builds them, with no label, and are passed as pads (real_lengths) as the trainer passes them, so the
kernels leave them out): the first row once untimed (kernel compilation), then every row, each
with its real tokens/s. `benchmarks/packing_gpu.py` writes such rows for first-fit and best-fit packings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

T0 = time.perf_counter()


def document_lengths(total: int, seed: int = 0, median: int = 60_000, sigma: float = 1.0,
                     lo: int = 4096, hi: int = 400_000) -> list[int]:
    """Heavy-tailed session lengths filling `total` tokens exactly (the last one cut to the room left)."""
    rng, out = random.Random(seed), []
    while sum(out) < total:
        n = int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma))))
        out.append(min(n, total - sum(out)))
    return out


def attention_ratio(lengths: list[int]) -> float:
    """Causal attention work of the packed row over one document of the same length: sum l(l+1) / L(L+1)."""
    total = sum(lengths)
    return sum(n * (n + 1) for n in lengths) / (total * (total + 1))


def _sync():
    torch.cuda.synchronize()


def _time_fwd_bwd(fn, q, k, v, dout, iters: int, **kw) -> dict:
    """Median forward and backward seconds over `iters` after one untimed call, and the peak memory above the
    inputs' (the kernel path's transients and outputs)."""
    fwd, bwd = [], []
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for i in range(iters + 1):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        _sync()
        t0 = time.perf_counter()
        out = fn(*leaves, **kw)
        _sync()
        t1 = time.perf_counter()
        out.backward(dout)
        _sync()
        t2 = time.perf_counter()
        if i:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        last = out.detach()
        del out, leaves
    fwd.sort()
    bwd.sort()
    f, b = fwd[len(fwd) // 2], bwd[len(bwd) // 2]
    return {"fwd_s": f, "bwd_s": b, "fwd_bwd_s": f + b,
            "peak_above_inputs_gb": (torch.cuda.max_memory_allocated() - base) / 2**30, "_out": last}


def attention_phase(length: int, lengths: list[int], hq: int, hkv: int, d: int, iters: int) -> dict:
    from ulysses_trainer.attention import kernels

    kernel = kernels.available_kernels()[0]
    fn = kernels.KERNEL_FUNCTIONS[kernel]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, length, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv))
    dout = torch.randn(1, length, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    scale = d ** -0.5
    res = {"kernel": kernel, "shape": {"length": length, "q_heads": hq, "kv_heads": hkv, "head_dim": d}}
    res["one_document"] = _time_fwd_bwd(fn, q, k, v, dout, iters, scale=scale)
    res["packed"] = _time_fwd_bwd(fn, q, k, v, dout, iters, scale=scale, cu_seqlens=cu, max_seqlen=max(lengths))
    if kernel == "flash_attention_4":  # the path before: the varlen kernel on all heads at once, no stash
        from flash_attn.cute.interface import flash_attn_varlen_func

        def all_heads(q, k, v, scale):
            out = flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                                         max_seqlen_k=max(lengths), softmax_scale=scale, causal=True)
            return (out[0] if isinstance(out, tuple) else out)[None]

        res["packed_all_heads_before"] = _time_fwd_bwd(all_heads, q, k, v, dout, iters, scale=scale)
        a, b = res["packed"]["_out"].float(), res["packed_all_heads_before"]["_out"].float()
        res["packed_vs_all_heads_rel_err"] = float((a - b).norm() / b.norm())
    # a check at this length against cuDNN one document at a time per group (the sdpa path)
    sd = kernels.sdpa_attention(q, k, v, scale=scale, cu_seqlens=cu, max_seqlen=max(lengths)).float()
    res["packed_vs_sdpa_rel_err"] = float((res["packed"]["_out"].float() - sd).norm() / sd.norm())
    for key in list(res):
        if isinstance(res[key], dict):
            res[key].pop("_out", None)
    ratio = attention_ratio(lengths)
    res["sum_l2_ratio"] = ratio
    res["time_ratio"] = res["packed"]["fwd_bwd_s"] / res["one_document"]["fwd_bwd_s"]
    return res


class PhaseTimer:
    """Wall seconds of the engine's forward, backward and optimizer step within a train step (synchronized)."""

    def __init__(self, engine):
        self.t = {"forward": 0.0, "backward": 0.0, "optimizer_step": 0.0}
        for attr, key in (("forward", "forward"), ("backward", "backward"), ("step", "optimizer_step")):
            setattr(engine, attr, self._wrap(getattr(engine, attr), key))

    def _wrap(self, f, key):
        def timed(*a, **kw):
            _sync()
            t0 = time.perf_counter()
            out = f(*a, **kw)
            _sync()
            self.t[key] += time.perf_counter() - t0
            return out
        return timed

    def take(self) -> dict:
        out, self.t = self.t, dict.fromkeys(self.t, 0.0)
        return out


def packed_row(lengths: list[int], total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [1, total] restarting at each document, pads continuing the last one's; the labels' mask
    [1, total] (False on pads)."""
    pad = total - sum(lengths)
    if pad < 0:
        raise SystemExit(f"a row of {sum(lengths)} tokens is over max_length {total}")
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(lengths[-1], lengths[-1] + pad)])[None]
    keep = torch.arange(total)[None] < sum(lengths)
    return pos, keep


def top_kernels(events, n: int = 40) -> list:
    by: dict[str, float] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start:
            by[e.name[:120]] = by.get(e.name[:120], 0.0) + (e.time_range.end - e.time_range.start) / 1e6
    return sorted(by.items(), key=lambda kv: -kv[1])[:n]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="a directory")
    ap.add_argument("--phases", default="attention,train,profile")
    ap.add_argument("--budget_s", type=float, default=540.0)
    ap.add_argument("--attn_iters", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--median", type=int, default=60_000, help="the documents' median length (a short smoke: less)")
    ap.add_argument("--length", type=int, default=None, help="the attention phase's length without train args")
    ap.add_argument("--rows", default=None, help="phase rows: a JSON file of named packed rows (document lengths)")
    args = ap.parse_args(argv[:split])
    train_args = argv[split + 1:]
    phases = set(args.phases.split(","))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "packed_step.json")
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "phases": {}}

    def save():
        result["elapsed_s"] = time.perf_counter() - T0
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    cfg = None
    if train_args:
        from ulysses_trainer.cli.argv import load_config

        cfg = load_config(train_args + ["--save_strategy", "no"])
    length = cfg.max_length if cfg is not None else args.length
    lengths = document_lengths(length, args.seed, median=args.median, lo=min(4096, args.median // 8))
    result["documents"] = {"lengths": lengths, "count": len(lengths), "median": sorted(lengths)[len(lengths) // 2],
                           "sum_l2_ratio": attention_ratio(lengths)}
    print(f"packed row: {len(lengths)} documents {lengths}, sum l^2 / L^2 = {attention_ratio(lengths):.4f}", flush=True)
    if "attention" in phases:
        if cfg is not None:
            from ulysses_trainer.families.presets import preset_config

            mc = preset_config(cfg.model_name_or_path)
            shape = (mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim)
        else:
            shape = (32, 8, 128)
        result["phases"]["attention"] = attention_phase(length, lengths, *shape, args.attn_iters)
        torch.cuda.empty_cache()
        save()
        print(json.dumps(result["phases"]["attention"]), flush=True)
    if cfg is None or not ({"train", "profile", "rows"} & phases):
        return 0

    from benchmarks.profile_train import summarize
    from ulysses_trainer.cli.train import _init_distributed
    from ulysses_trainer.parallel.sharding import IGNORE_INDEX, shard_batch
    from ulysses_trainer.train.prepare import prepare, world_size_from_env
    from ulysses_trainer.train.trainer import Trainer

    plan = prepare(cfg, world_size_from_env())
    _init_distributed()
    trainer = Trainer(plan)
    r = trainer.resolved
    result["plan"] = {"line": r.summary(), "kernel": plan.attn_implementation,
                      "predicted_step_s": r.predicted.step_s, "predicted_peak_gpu_gb": r.predicted.peak_gpu_gb,
                      "predicted_host_gb": r.predicted.host_gb, "kept_attention_layers": len(r.kept_attention_layers),
                      "startup_s": time.perf_counter() - T0}
    save()
    timer = PhaseTimer(trainer.engine)
    dense = trainer.micro_batches(0)
    ids = dense[0].input_ids.cpu()
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = [shard_batch(ids, position_ids=pos, sp_size=1, sp_rank=0).to(trainer.device)]
    assert packed[0].context.packed and packed[0].context.cu_seqlens.numel() == len(lengths) + 1

    def step(name: str, shards, profile: bool = False, real_tokens: int | None = None) -> float:
        torch.cuda.reset_peak_memory_stats()
        _sync()
        t0 = time.perf_counter()
        prof = None
        if profile:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        loss, norm, _ = trainer.train_step(shards)
        _sync()
        wall = time.perf_counter() - t0
        if prof is not None:
            prof.__exit__(None, None, None)
        # tokens, not targets
        real = sum(s.num_valid for s in shards) + sum(s.context.cu_seqlens.numel() - 1 for s in shards)
        if real_tokens is not None:
            real = real_tokens
        rec = {"step_s": wall, "loss": loss, "grad_norm": norm, "real_tokens": real,
               "targets": sum(s.num_valid for s in shards), "tokens_per_s": real / wall,
               "peak_gpu_gb": torch.cuda.max_memory_allocated() / 2**30,
               "peak_reserved_gb": torch.cuda.max_memory_reserved() / 2**30, "phases_s": timer.take()}
        if r.predicted.peak_gpu_gb:
            rec["peak_vs_plan"] = rec["peak_gpu_gb"] / r.predicted.peak_gpu_gb - 1
        if prof is not None:
            events = prof.events()
            rec["profile"] = summarize(events)
            rec["profile"]["gpu_idle_s"] = wall - rec["profile"]["gpu_busy_s"]
            rec["profile"]["top_kernels"] = top_kernels(events)
        result["phases"][name] = rec
        save()
        print(name, json.dumps({k: v for k, v in rec.items() if k != "profile"}), flush=True)
        if prof is not None:
            print("profile", json.dumps({k: v for k, v in rec["profile"].items() if k != "top_kernels"}), flush=True)
        return wall

    if "rows" in phases:
        with open(args.rows) as f:
            rows = json.load(f)
        built = {}
        for name, lens in rows.items():
            rpos, keep = packed_row(lens, ids.shape[1])
            labels = ids.masked_fill(~keep, IGNORE_INDEX)
            shard = shard_batch(ids, position_ids=rpos, labels=labels, sp_size=1, sp_rank=0, real_lengths=[sum(lens)])
            built[name] = ([shard.to(trainer.device)], sum(lens))
        first_name = next(iter(built))
        step("rows_warmup_untimed", built[first_name][0], real_tokens=built[first_name][1])
        for name, (shards, real) in built.items():
            if time.perf_counter() - T0 + result["phases"]["rows_warmup_untimed"]["step_s"] > args.budget_s:
                break
            step("row " + name, shards, real_tokens=real)
            result["phases"]["row " + name]["lengths"] = rows[name]
            # the real documents' attention (the pads are segments the kernels leave out) over one full document
            result["phases"]["row " + name]["sum_l2_ratio"] = \
                sum(n * (n + 1) for n in rows[name]) / (ids.shape[1] * (ids.shape[1] + 1))
            save()
        return 0
    first = step("one_document_step1_untimed", dense)
    left = lambda: args.budget_s - (time.perf_counter() - T0)  # noqa: E731
    if "train" in phases and left() > first:
        step("packed", packed)
    if left() > first * 1.05:
        step("one_document", dense, profile="profile" in phases)
    ph = result["phases"]
    if "packed" in ph and "one_document" in ph:
        att = ph.get("attention")
        sm = {"speedup": ph["one_document"]["step_s"] / ph["packed"]["step_s"],
              "tokens_per_s_ratio": ph["packed"]["tokens_per_s"] / ph["one_document"]["tokens_per_s"]}
        if att:  # what the attention kernels alone predict: the step minus layers x the attention time saved
            layers = plan.model_config.num_hidden_layers
            saved = layers * (att["one_document"]["fwd_bwd_s"] - att["packed"]["fwd_bwd_s"])
            at_ratio = layers * (att["one_document"]["fwd_bwd_s"]) * (1 - att["sum_l2_ratio"])
            sm["predicted_packed_step_s_from_kernel_times"] = ph["one_document"]["step_s"] - saved
            sm["predicted_packed_step_s_from_sum_l2"] = ph["one_document"]["step_s"] - at_ratio
        result["summary"] = sm
        save()
        print("summary", json.dumps(sm), flush=True)
    return 0


if __name__ == "__main__":
    from ulysses_trainer.cli.console import use_console

    use_console()  # the package's messages as the commands show them
    raise SystemExit(main())
