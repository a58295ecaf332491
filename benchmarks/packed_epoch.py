"""A mixed packed epoch through the real trainer, on one GPU: each row's step time against what its FLOPs say.

    python benchmarks/packed_epoch.py --out DIR [--rows 6] [--budget_s 540] \
        -- --config launch/recipes/one_gpu_4b_sessions.yaml [--name value ...]

The rows: the recipe's data built as the trainer builds it (`synthetic:agent_sessions_mixed`: deterministic agent
sessions of 4K-400K tokens, median 60K; no network, no datasets library), `--rows` of them (the synthetic source
makes as many as asked), packed by the recipe's packing_strategy. One untimed step on the first row (kernel
compilation, pinned pools), then one optimizer step per row in the trainer's epoch order, each row sharded as the
trainer shards it (its pads passed as pads: train/data_order.shard_rows).

Per row: its real documents, f = sum(l_i^2) / L^2 (the pads cost none), its real tokens, the step's seconds, real
tokens/s, tflops_per_gpu and mfu as metrics.jsonl counts them. Against FLOP-proportional time:
- `plan`: a + b * f with b the plan's attention seconds for one whole document of L (its step_parts' attention terms
  over the fraction it was planned at) and a the rest of its predicted step: the model's prediction, not fitted;
- `fit`: a + b * f fitted to the measured rows (least squares), and t = c + a * tokens / L + b * f (the MLP and the
  projections skip nothing but the tiled MLP's pads, so a row's dense work follows its real tokens).
The epoch: measured seconds, real tokens/s, and measured / FLOP-proportional for both lines (1.0: every row costs
what its FLOPs say). DIR/packed_epoch.json is written after every row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

T0 = time.perf_counter()


def flop_line(fractions: list[float], tokens: list[float], seconds: list[float], L: int) -> dict:
    """The fitted lines: t = a + b f, and t = c + a tokens/L + b f (where the rows allow it)."""
    f, t, n = np.array(fractions), np.array(seconds), np.array(tokens) / L
    out: dict = {}
    if len(f) >= 2 and np.ptp(f) > 0:
        b, a = np.polyfit(f, t, 1)
        pred = a + b * f
        out["a_plus_b_f"] = {"a_s": float(a), "b_s": float(b), "predicted_s": pred.tolist(),
                             "residual": (t / pred - 1).tolist(),
                             "epoch_measured_over_fit": float(t.sum() / pred.sum())}
    if len(f) >= 4:
        x = np.stack([np.ones_like(f), n, f], 1)
        coef, *_ = np.linalg.lstsq(x, t, rcond=None)
        pred = x @ coef
        out["c_plus_a_tokens_plus_b_f"] = {"c_s": float(coef[0]), "a_s": float(coef[1]), "b_s": float(coef[2]),
                                           "residual": (t / pred - 1).tolist()}
    return out


def plan_line(resolved) -> tuple[float, float] | None:
    """(a, b) of the plan: b its attention seconds for one whole document of L, a the rest of its step (None where
    the plan predicts no step time: a CPU)."""
    p = resolved.predicted
    if p.step_s is None:
        return None
    parts = dict(p.step_parts)
    attention = sum(v for k, v in parts.items() if "attention" in k)
    frac = resolved.run.attention_fraction or 1.0
    return p.step_s - attention, attention / frac


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="a directory (packed_epoch.json)")
    ap.add_argument("--rows", type=int, default=6, help="rows the synthetic source makes (the epoch)")
    ap.add_argument("--budget_s", type=float, default=540.0, help="stop before a row that would overrun this")
    args = ap.parse_args(argv[:split])
    train_args = argv[split + 1:] or ["--config", "launch/recipes/one_gpu_4b_sessions.yaml"]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "packed_epoch.json")
    result: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "torch": torch.__version__, "args": train_args, "rows": []}

    def save():
        result["elapsed_s"] = time.perf_counter() - T0
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    from ulysses_trainer.cli.argv import load_config
    from ulysses_trainer.cli.train import _init_distributed
    from ulysses_trainer.data.documents import build_sequences
    from ulysses_trainer.data.order import epoch_permutation
    from ulysses_trainer.plan.attention_share import row_documents
    from ulysses_trainer.train.data_order import shard_rows
    from ulysses_trainer.train.metrics import device_peak_tflops, row_model_flops, throughput
    from ulysses_trainer.train.prepare import prepare, world_size_from_env
    from ulysses_trainer.train.trainer import Trainer

    cfg = load_config(train_args + ["--save_strategy", "no", "--overwrite_output_dir", "true"])
    plan = prepare(cfg, world_size_from_env())
    _init_distributed()
    trainer = Trainer(plan)
    r = trainer.resolved
    L = cfg.max_length
    ds = build_sequences(cfg, plan.tokenizer, split="train", num_sequences=args.rows)
    flops = row_model_flops(plan.shape, ds)
    peak = device_peak_tflops(trainer.device)
    line = plan_line(r)
    result["plan"] = {"line": r.summary(), "kernel": plan.attn_implementation,
                      "predicted_step_s": r.predicted.step_s,
                      "attention_fraction": r.run.attention_fraction, "a_s": line and line[0], "b_s": line and line[1]}
    result["data"] = ds.counts.summary()
    result["peak_tflops"] = list(peak) if peak else None
    save()
    print(f"[packed_epoch] {len(ds)} rows: {ds.counts.summary()}\n[packed_epoch] plan: {r.summary()}", flush=True)

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def timed(i: int) -> float:
        shard = shard_rows([ds[i]], plan, trainer.state, trainer.device)
        sync()
        t0 = time.perf_counter()
        trainer.train_step([shard])
        sync()
        return time.perf_counter() - t0

    order = epoch_permutation(cfg.seed, len(ds), 0).tolist()
    warm = timed(order[0])
    result["warmup_untimed_s"] = warm
    save()
    last = warm
    for i in order:
        if time.perf_counter() - T0 + last * 1.2 > args.budget_s:
            result["stopped"] = f"budget: {len(result['rows'])} of {len(ds)} rows timed"
            break
        docs = row_documents(ds, i)
        f = float((docs.astype(np.float64) ** 2).sum()) / L**2
        last = timed(i)
        rates = throughput(float(flops[i]), last, 1, peak)
        row = {"row": i, "documents": docs.tolist(), "real_tokens": int(docs.sum()), "pads": L - int(docs.sum()),
               "sum_l2_ratio": f, "step_s": last, "real_tokens_per_s": int(docs.sum()) / last, **rates}
        if line is not None:
            row["plan_flop_proportional_s"] = line[0] + line[1] * f
            row["measured_over_plan"] = last / row["plan_flop_proportional_s"]
        result["rows"].append(row)
        rows = result["rows"]
        t = [x["step_s"] for x in rows]
        result["epoch"] = {"rows": len(rows), "measured_s": sum(t),
                           "real_tokens_per_s": sum(x["real_tokens"] for x in rows) / sum(t),
                           "fits": flop_line([x["sum_l2_ratio"] for x in rows], [x["real_tokens"] for x in rows],
                                             t, L)}
        if line is not None:
            result["epoch"]["measured_over_plan_flop_proportional"] = \
                sum(t) / sum(x["plan_flop_proportional_s"] for x in rows)
        save()
        print("[packed_epoch] " + json.dumps({k: v for k, v in row.items() if k != "documents"}), flush=True)
    print("[packed_epoch] epoch " + json.dumps(result.get("epoch", {})), flush=True)
    return 0


if __name__ == "__main__":
    from ulysses_trainer.cli.console import use_console

    use_console()
    raise SystemExit(main())
