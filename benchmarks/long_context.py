"""Long-context step benchmark: peak GPU/host memory, step time, tokens/s and model TFLOP/s per
system and sequence length, one GPU, DeepSpeed ZeRO-3, bf16, torch AdamW (states fp32 on the GPU).

    python benchmarks/long_context.py --system ours --model qwen3-4b --lengths 32768,65536 --out r.json

Lengths run in increasing order in one process; the first OOM ends the sweep (recorded as such).
In `train` mode run one length per process: DeepSpeed keeps parts of an engine alive after it is
dropped, so a second length in the same process starts with the first one's memory still held.
Use `--steps 2` in train mode: Adam's m and v appear only in the first optimizer step.
`--standin-from N` swaps the attention kernel for the memory-only stand-in at lengths >= N
(labelled `attention: standin_memory_only` in the results): memory is real, time is not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import threading
import time

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from benchmarks.systems import SYSTEMS  # noqa: E402
from ulysses_trainer.families.presets import preset_config  # noqa: E402
from ulysses_trainer.model.load import build_model  # noqa: E402
from ulysses_trainer.train.adam_states import materialize_adam_states  # noqa: E402
from ulysses_trainer.train.metrics import train_flops_per_sequence  # noqa: E402
from ulysses_trainer.vocabulary.names import KEEPING_KERNELS, OFFLOAD_SUB_GROUP_SIZE, STANDIN  # noqa: E402


class HostPeak:
    """Samples this process's RSS every 20 ms; pinned host buffers count once touched."""

    def __init__(self):
        self.proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.02)

    def __enter__(self):
        self.peak = self.proc.memory_info().rss
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def _init_dist():
    from ulysses_trainer.parallel.init import init_distributed

    if "MASTER_PORT" not in os.environ:  # a free port: two benchmarks at once (or another job) must not share one
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)
    init_distributed("nccl" if torch.cuda.is_available() else "gloo")




def _ds_config(bf16: bool, offload_optimizer: bool = False) -> dict:
    zero = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
            "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9}
    extra = {}
    if offload_optimizer:  # fp32 master, grads and Adam m, v in pinned host memory; torch AdamW steps on the CPU
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["sub_group_size"] = OFFLOAD_SUB_GROUP_SIZE
        extra["zero_force_ds_cpu_optimizer"] = False
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1,
            "gradient_clipping": 1.0, "bf16": {"enabled": bf16}, "zero_allow_untested_optimizer": True,
            "zero_optimization": zero, "steps_per_print": 2**31 - 1, **extra}


def run(args) -> dict:
    import deepspeed

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = preset_config(args.model)
    lengths = [int(x) for x in args.lengths.split(",")]
    _init_dist()
    results = {"system": args.system, "model": args.model, "kernel": args.kernel, "points": [],
               "machine": {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "host": platform.node(),
                           "host_ram_gb": psutil.virtual_memory().total / 2**30},
               "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                            "transformers": __import__("transformers").__version__,
                            "python": platform.python_version()},
               "settings": {"zero_stage": 3, "dtype": str(dtype), "optimizer": "torch.optim.AdamW (fp32 states on GPU)",
                            "batch": 1, "offload": args.offload, "steps_per_length": args.steps, "mode": args.mode}}
    for L in lengths:
        standin = args.standin_from is not None and L >= args.standin_from
        kernel = STANDIN if standin else args.kernel
        if args.system != "ours" and standin:
            kernel = _register_hf_standin()
        point = {"seq_len": L, "attention": kernel}
        engine = None
        try:
            with torch.device(device):
                model = build_model(config, dtype, seed=0)
            ours = ({"lean_norm": args.lean_norm == "true", "checkpoint_every": args.checkpoint_every,
                     "keep_attention_outputs": _policy(args.keep_attention_outputs)}
                    if args.system == "ours" else {})
            if args.system == "ours":  # the kernels attention/grouped.py runs one KV-head group at a time
                point["grouped_attention"] = kernel in KEEPING_KERNELS
            net = SYSTEMS[args.system](model, kernel, L, args.offload, under_zero3=args.mode == "train", **ours)
            point.update(ours)
            fwdbwd = args.mode == "fwdbwd"
            if getattr(net, "untied_lm_head", False):
                point["note"] = ("lm_head untied (+vocab x hidden params): ALST's fused loss fails on a tied one "
                                 "under ZeRO-3")
            if fwdbwd:  # no engine, no optimizer: bf16 weights + grads, as the earlier baselines measured
                engine = None
            else:
                opt = torch.optim.AdamW(net.parameters(), lr=1e-5, fused=cuda and not args.offload_optimizer)
                engine, *_ = deepspeed.initialize(model=net, optimizer=opt,
                                                  config=_ds_config(cuda, args.offload_optimizer))
                point["offload_optimizer"] = args.offload_optimizer
                if args.offload_optimizer:
                    point["sub_group_size"] = OFFLOAD_SUB_GROUP_SIZE
                if standin:  # the stand-in's updates may all be skipped (non-finite norms): make m, v exist
                    point["adam_states"] = materialize_adam_states(engine)
                    point["first_step"] = False  # planned as a later step: m, v held through fwd/bwd
                point["host_rss_after_init_gb"] = psutil.Process().memory_info().rss / 2**30  # engine + optimizer
            if args.system == "ours" and cuda:
                _plan_ours(net, config, L, kernel, model=args.model, offload=_policy(args.offload),
                           keep=_policy(args.keep_attention_outputs), every=args.checkpoint_every,
                           lean_norm=args.lean_norm == "true", optimizer_offload=bool(args.offload_optimizer))
                point["offloaded_layers"] = len(net.sp_model.checkpointer.offload_layers)
                stash = net.sp_model.attention.stash
                point["kept_attention_layers"] = len(stash.layers) if stash is not None else 0
                print(json.dumps({"seq_len": L, "phase": "before_step", **point}), flush=True)
            ids = torch.randint(0, config.vocab_size, (1, L), generator=torch.Generator().manual_seed(L)).to(device)
            pos = torch.arange(L, device=device)[None]
            if fwdbwd and args.warmup_tokens:  # compile / plan the kernels outside the timed step
                net(ids[:, :args.warmup_tokens], pos[:, :args.warmup_tokens]).backward()
                net.zero_grad(set_to_none=True)
                point["warmup_tokens"] = args.warmup_tokens
            times = []
            with HostPeak() as host:
                for _ in range(args.steps):
                    if cuda:
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()  # static weights/states stay counted
                    t0 = time.perf_counter()
                    if fwdbwd:
                        loss = net(ids, pos)
                        loss.backward()
                        net.zero_grad(set_to_none=True)
                    else:
                        loss = engine(ids, pos)
                        engine.backward(loss)
                        engine.step()
                    if cuda:
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
            dt = times[-1]
            flops = train_flops_per_sequence(config, L)
            point.update(status="ok", loss=float(loss.detach()), step_s=dt, all_step_s=times,
                         peak_gpu_gb=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                         peak_gpu_reserved_gb=torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
                         peak_host_rss_gb=host.peak / 2**30)
            if engine is not None:  # a skipped update never creates Adam's m, v: their memory is then absent
                point["skipped_steps"] = int(engine.skipped_steps)
            if not standin:
                point.update(tokens_per_s=L / dt, model_tflops=flops / dt / 1e12)
        except torch.cuda.OutOfMemoryError as exc:
            point.update(status="oom", error=str(exc).splitlines()[0][:300])
        except Exception as exc:  # noqa: BLE001 - a benchmark records the failure and moves on
            point.update(status="error", error=f"{type(exc).__name__}: {exc}"[:500])
        print(json.dumps(point), flush=True)
        results["points"].append(point)
        _save(args.out, results)  # after every point: a sweep cut short by a timeout keeps what it measured
        engine = net = model = opt = loss = None  # noqa: F841 - drop every reference before the next build
        _free(device)
        if point["status"] != "ok":
            break
    return results


def _plan_ours(net, config, L, kernel, *, model: str, offload, keep, every=1, lean_norm=True,
               optimizer_offload=False) -> None:
    """The trainer's own resolution (plan/resolve.py) for this point, applied to the model. Without an
    optimizer (fwdbwd, profiles) the plan still reserves Adam's states: the settings it picks are safe, not tight."""
    from ulysses_trainer.attention.kernels import available_kernels
    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.levers.host_pool import detect_host_memory_gb
    from ulysses_trainer.model.parallelize import apply
    from ulysses_trainer.plan.inputs import ModelShape
    from ulysses_trainer.plan.resolve import resolve_plan
    from ulysses_trainer.plan.types import Machine

    tiles = net.sp_model.setup.levers.tiled_mlp
    cfg = TrainConfig(model_name_or_path=model, max_length=L, sp_size=1, bf16=True, attn_implementation=kernel,
                      activation_offload=offload, keep_attention_outputs=keep, tiled_mlp=tiles,
                      checkpoint_every=every, lean_norm=lean_norm, optimizer_offload=optimizer_offload)
    machine = Machine(gpus=1, gpu_memory_gb=torch.cuda.get_device_properties(0).total_memory / 2**30,
                      host_memory_gb=detect_host_memory_gb(),
                      kernels=tuple(available_kernels()) if kernel == "auto" else (kernel,),
                      gpu_name=torch.cuda.get_device_name(), host_memory_source="detected on this machine")
    plan = resolve_plan(cfg, ModelShape.from_config(config), machine)
    print(f"plan: {plan.summary()}", flush=True)
    apply(net.sp_model, plan.model_setup(None, 1))


def _policy(text: str):
    """A lever policy from the command line: false / true / auto / an int."""
    if text.isdigit():
        return int(text)
    if text not in ("false", "true", "auto"):
        raise SystemExit(f"error: {text!r} is not false, true, auto or a layer count")
    return {"false": False, "true": True, "auto": "auto"}[text]


def _register_hf_standin() -> str:
    from transformers import AttentionInterface

    from ulysses_trainer.attention.standin import standin_attention_full_heads

    def fn(module, q, k, v, mask, scaling=None, **kw):  # HF layout [b, h, s, d] in, [b, s, h, d] out
        return standin_attention_full_heads(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                            scale=scaling), None

    AttentionInterface.register("standin_hf", fn)
    return "standin_hf"


def _free(device):
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--lengths", default="32768,65536,131072,262144")
    ap.add_argument("--kernel", default="sdpa", help="attention kernel (ours: auto/sdpa/flash_attention_4)")
    ap.add_argument("--offload", default="auto", help="ours: activation_offload policy; alst: true")
    ap.add_argument("--standin-from", type=int, default=None)
    ap.add_argument("--lean-norm", choices=["true", "false"], default="true", help="ours: lean RMSNorms")
    ap.add_argument("--checkpoint-every", type=int, default=1, help="ours: keep 1 in k layer inputs")
    ap.add_argument("--keep-attention-outputs", default="false",
                    help="ours: false, true, auto or N layers keep attention outputs for the recompute")
    ap.add_argument("--offload-optimizer", action="store_true", help="train mode: ZeRO-Offload of the optimizer")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--warmup-tokens", type=int, default=0,
                    help="fwdbwd mode: one untimed forward+backward on this many tokens first (kernel JIT, plans)")
    ap.add_argument("--mode", choices=["train", "fwdbwd"], default="train",
                    help="train: ZeRO-3 engine + AdamW step; fwdbwd: forward+backward only (no optimizer)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    args.offload = _policy(args.offload.lower())
    _save(args.out, run(args))


def _save(path, results):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
