"""Attribution of one rehearsal step's GPU (or, on CPU, live-storage) peak by allocating frame.

    python benchmarks/memory_attribution.py OUT_JSON [--cpu_small] -- <rehearse args>

Builds what `ulysses-trainer rehearse` builds (rank 0 on the fake group), runs ONE train step with the CUDA
allocator history (python stacks) recording and a dispatch mode that names every aten op (and the autograd
node running it) in the python stack, then lists the live blocks at the step's peak and at the peaks of
sub-phases, grouped by allocating frame, in units of t x hidden x e bytes.
On CPU the same dispatch mode tracks live storages itself (alloc / free events in the CUDA trace format).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
import types
from collections import defaultdict

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

SKIP = ("torch/nn/modules/module.py", "torch/autograd/function.py", "contextlib.py", "functools.py",
        "torch/utils/_contextlib.py", "torch/_ops.py", "torch/utils/_python_dispatch.py", "torch/_compile.py",
        "torch/_dynamo", "torch/utils/_device.py", "snap.py", "torch/_tensor.py", "torch/overrides.py",
        "accelerate/hooks.py", "deepspeed/utils/nvtx.py", "torch/_library", "threading.py")


def _short(fn: str) -> str:
    for root in ("ulysses_trainer/", "transformers/", "deepspeed/", "torch/", "liger_kernel/", "triton/"):
        i = fn.rfind(root)
        if i >= 0:
            return fn[i:]
    return os.path.basename(fn)


class OpNamer(TorchDispatchMode):
    """Runs every op inside a function whose name says the op and the autograd node: the CUDA history's python
    stack then names C++ autograd work too. With track=True (CPU) it also records alloc/free events."""

    def __init__(self, track: bool = False):
        super().__init__()
        self._fns: dict[str, types.FunctionType] = {}
        self.track = track
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}  # key -> (ref, bytes)
        self.trace: list[dict] = []

    def _fn(self, name: str):
        f = self._fns.get(name)
        if f is None:
            def runner(func, args, kwargs):
                return func(*args, **kwargs)
            f = types.FunctionType(runner.__code__.replace(co_name=name, co_qualname=name), runner.__globals__)
            self._fns[name] = f
        return f

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        node = torch._C._current_autograd_node()
        name = f"OP[{func}]" + (f"@{node.name()}" if node is not None else "")
        if self.track:
            self._collect()
        out = self._fn(name)(func, args, kwargs or {})
        if self.track:
            frames = [{"filename": f.filename, "line": f.lineno, "name": f.name}
                      for f in reversed(traceback.extract_stack()[:-1])]
            frames.insert(0, {"filename": "<op>", "line": 0, "name": name})
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_meta:
                    st = t.untyped_storage()
                    key = st.data_ptr()
                    if st.nbytes() == 0 or key in self.live and not self.live[key][0].expired():
                        continue
                    self.live[key] = (StorageWeakRef(st), st.nbytes())
                    self.trace.append({"action": "alloc", "addr": key, "size": st.nbytes(), "frames": frames})
        return out

    def _collect(self):
        dead = [k for k, (r, _) in self.live.items() if r.expired()]
        for k in dead:
            _, n = self.live.pop(k)
            self.trace.append({"action": "free_requested", "addr": k, "size": n})


def levels(trace, start):
    lv, out = start, []
    for ev in trace:
        if ev["action"] == "alloc":
            lv += ev["size"]
        elif ev["action"] == "free_requested":
            lv -= ev["size"]
        out.append(lv)
    return out


def live_at(trace, i):
    live = {}
    for j, ev in enumerate(trace[:i + 1]):
        if ev["action"] == "alloc":
            live[ev["addr"]] = (j, ev)
        elif ev["action"] == "free_requested":
            live.pop(ev["addr"], None)
    return live


def frame_key(frames, depth=3):
    ops = [f["name"] for f in frames if f["name"].startswith("OP[")]
    keep = [f"{_short(f['filename'])}:{f['line']}:{f['name']}" for f in frames
            if not f["name"].startswith("OP[") and f["filename"] != "<op>"
            and not any(s in f["filename"] for s in SKIP)]
    return (ops[0] if ops else "-") + " | " + " < ".join(keep[:depth])


def describe(trace, i, start, unit, top=30):
    live = live_at(trace, i)
    groups = defaultdict(lambda: [0, 0, []])
    for _, (_j, ev) in live.items():
        k = frame_key(ev.get("frames", []))
        g = groups[k]
        g[0] += ev["size"]
        g[1] += 1
        g[2].append(round(ev["size"] / unit, 3))
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    out = [{"units": round(v[0] / unit, 3), "n": v[1], "sizes": sorted(v[2], reverse=True)[:8], "where": k}
           for k, v in rows[:top]]
    rest = sum(v[0] for _, v in rows[top:])
    ev = trace[i]
    return {"event": i, "level_units": round((start + sum(e["size"] for _, e in live.values())) / unit, 3),
            "before_step_units": round(start / unit, 3),
            "step_live_units": round(sum(e["size"] for _, e in live.values()) / unit, 3),
            "peak_alloc": {"size_units": round(ev.get("size", 0) / unit, 3),
                           "where": frame_key(ev.get("frames", []), 6)},
            "groups": out, "rest_units": round(rest / unit, 3),
            "recent_allocs": [{"ev": j, "u": round(trace[j]["size"] / unit, 3), "live": trace[j]["addr"] in live
                               and live[trace[j]["addr"]][0] == j, "where": frame_key(trace[j].get("frames", []), 2)}
                              for j in range(max(0, i - 60), i + 1) if trace[j]["action"] == "alloc"
                              and trace[j]["size"] >= unit / 64]}


def _has(frames, file_part, names):
    return any(file_part in f["filename"] and f["name"] in names for f in frames)


def analyse(trace, start, unit):
    lv = levels(trace, start)
    allocs = [i for i, ev in enumerate(trace) if ev["action"] == "alloc"]
    res = {"n_events": len(trace), "start_units": round(start / unit, 3)}
    peak = max(range(len(lv)), key=lv.__getitem__)
    res["global_peak"] = describe(trace, peak, start, unit)
    cats = {
        "attention_kernel_bwd": lambda fr: _has(fr, "attention/standin.py", {"backward"})
        or _has(fr, "attention/grouped.py", {"backward", "_standin_bwd"}),
        "all_to_all_bwd": lambda fr: _has(fr, "parallel/comm.py", {"backward"}),
        "sdpa_node_bwd": lambda fr: any(f["name"].startswith("OP[") and "ScaledDotProduct" in f["name"]
                                        and "Backward" in f["name"] for f in fr),
        "tiled_mlp_bwd": lambda fr: _has(fr, "levers/tiled_mlp.py", {"backward"}),
        # a Gated DeltaNet layer's rule backward in fla's chunked kernels (the torch rule is plain autograd ops)
        "deltanet_rule_bwd": lambda fr: _has(fr, "fla/ops/", {"backward"}),
    }
    for name, pred in cats.items():
        idx = [i for i in allocs if pred(trace[i].get("frames", []))]
        if idx:
            i = max(idx, key=lv.__getitem__)
            res[name] = describe(trace, i, start, unit)
    return res


def build(argv, cpu_small):
    from ulysses_trainer.cli.argv import split_argv
    from ulysses_trainer.cli.rehearse import _FLAGS, _OWN, _parser, load_rehearsal_config
    from ulysses_trainer.train.prepare import prepare

    ours, overrides = split_argv(argv, _OWN, _FLAGS)
    args = _parser().parse_args(ours)
    cfg = load_rehearsal_config(args, overrides)
    if cpu_small:  # qwen3-8b's head layout (32 q / 8 kv heads) at toy width, few layers
        cfg = dataclasses.replace(cfg, model_init_kwargs={"hidden_size": 256, "intermediate_size": 768,
                                                          "num_hidden_layers": 3, "head_dim": 8})
    # no verify_sp, as in the rehearsal: the fake group's collectives move no data, so no SP run equals the stock one
    cfg = dataclasses.replace(cfg, verify_sp=False)
    return args, prepare(cfg, args.gpus)


def main():
    out_path = sys.argv[1]
    cpu_small = "--cpu_small" in sys.argv
    argv = sys.argv[sys.argv.index("--") + 1:]
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import warnings

    from ulysses_trainer.parallel.fake import fake_process_group
    from ulysses_trainer.train.adam_states import materialize_adam_states
    from ulysses_trainer.train.trainer import Trainer
    warnings.filterwarnings("ignore", category=FutureWarning)
    args, plan = build(argv, cpu_small)
    cuda = plan.device == "cuda"
    res = {"argv": argv}
    t0 = time.time()
    with fake_process_group(0, plan.world_size, 8, plan.device):
        trainer = Trainer(plan)
        engine = trainer.engine
        materialize_adam_states(engine)
        c = trainer.model.config
        t = plan.padded_length // plan.sp_size * plan.cfg.per_device_train_batch_size
        e = 2 if plan.bf16 else 4
        unit = t * c.hidden_size * e
        stash = trainer.model.attention.stash
        res.update(local_tokens=t, hidden=c.hidden_size, unit_bytes=unit, kernel=trainer.model.attention.kernel,
                   kept=len(stash.layers) if stash is not None else 0, tiles=trainer.resolved.run.levers.tiled_mlp,
                   checkpoint_every=trainer.resolved.run.levers.checkpoint_every,
                   offloaded=len(trainer.model.checkpointer.offload_layers),
                   predicted_by_plan_peak_gpu_gb=trainer.resolved.predicted.peak_gpu_gb, build_s=time.time() - t0)
        print("built", res, flush=True)
        batches = trainer.micro_batches(0)
        if "--warm" in sys.argv[:sys.argv.index("--")]:
            trainer.train_step(batches)  # step 1 unrecorded: the recorded step is a steady one
            batches = trainer.micro_batches(1)
        namer = OpNamer(track=not cuda)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                     max_entries=3_000_000)
        else:
            start = 0
        t1 = time.time()
        try:
            with namer:
                trainer.train_step(batches)
            if cuda:
                torch.cuda.synchronize()
                snap = torch.cuda.memory._snapshot()
        finally:
            if cuda:
                torch.cuda.memory._record_memory_history(enabled=None)
        res["step_s"] = time.time() - t1
        if cuda:
            trace = snap["device_traces"][0]
            res["torch_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
            res["trace_truncated"] = len(trace) >= 3_000_000
            end = torch.cuda.memory_allocated()
            # the start level recovered from the end, as train/diagnostics.allocated_curve
            start = end - sum(ev["size"] if ev["action"] == "alloc" else -ev["size"] if ev["action"] == "free_requested"
                              else 0 for ev in trace)
        else:
            namer._collect()
            trace = namer.trace
        res["trace_peak_gb"] = (start + max(0, max(levels(trace, 0)))) / 2**30
        res.update(analyse(trace, start, unit))
        res["analyse_s"] = time.time() - t1 - res["step_s"]
        trainer = engine = None
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", out_path, "peak", res.get("torch_peak_gb"), res["trace_peak_gb"], flush=True)


if __name__ == "__main__":
    from ulysses_trainer.cli.console import use_console

    use_console()  # the package's messages as the commands show them
    main()
