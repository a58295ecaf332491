"""`ulysses-trainer rehearse`: one rank of an N-GPU job, in one process, on one device.

    ulysses-trainer rehearse --config RECIPE.yaml --gpus N [--rank R] [--steps K] [--warmup_length N]
        [--standin] [--host_standin] [--layer_times] [--comm FILE] [--gpus_per_node G] [--internode_gbps X]
        [--a2a_hidden F] [--zero3_hidden F] [--collective_fill local|none] [--count_collectives] [--json] [--out FILE]
        [--name value ...]

The process plays rank R (default 0) of the N-rank job on torch's fake process group (parallel/fake.py)
and builds what the trainer builds (prepare, Trainer: the model, parallelize, the ZeRO-3 engine with
partitions for N ranks), then runs K train steps (default 2: one warm-up, then the timed ones). Real:
this rank's memory (GPU peak, host peak RSS) and its kernels' time. Not run: communication, which is
added from the model of the job's collectives (plan/comm_model.py) at measured or assumed bandwidths.
Each collective's output holds this rank's own values (`--collective_fill local`, the default: an all-gather
its input in every slot, an all-to-all its input, a reduce-scatter its slice), so kernels see real-looking data
and every update is finite and timed; `none` leaves the buffers as allocated (zeros or stale memory), on which
an H200 runs ~20% faster: for comparison only. The losses are meaningless either way.
Any other `--name value` overrides the recipe, as for launch/train.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

from ..config import REPO_ROOT
from ..errors import EXIT_FAILURE, EXIT_INVALID, EXIT_OK, ConfigError, TrainerError
from ..plan.comm_model import DEFAULT_COMM_FILE as COMM_FILE
from ..train.rehearsal import Rehearsal, comm_job, run_rehearsal
from ..vocabulary.names import STANDIN, STANDIN_FA4
from .argv import split_argv
from .console import use_console

# The measured NCCL points the rehearsal uses when --comm is not given (benchmarks/comm_bandwidth.py)
DEFAULT_COMM_FILE = Path(COMM_FILE)
_FLAGS = {"json", "standin", "host_standin", "layer_times", "count_collectives", "help"}  # take no value
_OWN = {"config", "gpus", "rank", "steps", "warmup_length", "out", "comm", "gpus_per_node", "internode_gbps",
        "host_cores", "a2a_hidden", "zero3_hidden", "a2a_stall_s_per_gb", "collective_fill", "gpus_per_host", *_FLAGS}
MEANINGLESS = ("losses are meaningless: collectives on the fake process group move no data; what they would "
               "fill holds this rank's own values (collective_fill local) or whatever was there (none)")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one `error:` line, exit 2, like every other bad input
        raise ConfigError(f"{message} (ulysses-trainer rehearse --help lists the options)")


def _parser() -> argparse.ArgumentParser:
    from ..parallel.local_fill import FILLS
    from ..plan.comm_model import A2A_STALL_S_PER_GB, DEFAULT_INTERNODE_GBPS

    ap = _Parser(prog="ulysses-trainer rehearse", description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="a training recipe (YAML)")
    ap.add_argument("--gpus", type=int, required=True, help="ranks in the job being rehearsed (N)")
    ap.add_argument("--rank", type=int, default=0, help="which rank this process plays (default 0)")
    ap.add_argument("--steps", type=int, default=2, help="train steps: the first is a warm-up, the rest are "
                                                         "timed (default 2)")
    ap.add_argument("--warmup_length", type=int,
                    help="tokens per sequence in the warm-up step (default max_length): it compiles kernels and "
                         "lets DeepSpeed record its module order as well at a fraction of the time; each row's "
                         "documents and pads are scaled to it, so the same kernels compile")
    ap.add_argument("--standin", action="store_true",
                    help="memory only: the attention stand-in replaces the kernel (memory real, time not); with "
                         "--attn_implementation flash_attention_4 it takes that kernel's path (every layer group "
                         "by group)")
    ap.add_argument("--host_standin", action="store_true",
                    help="the offloaded layer inputs share two host slots, so a host with less RAM than the job's "
                         "rehearses it: the same copies both ways, each recompute from another layer's input "
                         "(timed as the job, its values not the job's); the host share is counted (the result's "
                         "host_offload_counted_gb and peak_host_job_gb), not held")
    ap.add_argument("--layer_times", action="store_true",
                    help="time the last step layer by layer (CUDA events at the layers' forward hooks and the "
                         "checkpointer's marks; no profiler): the JSON's layer_times and one summary line")
    ap.add_argument("--comm", help=f"measured bandwidth JSON (default {DEFAULT_COMM_FILE.relative_to(REPO_ROOT)} "
                                   f"if present, else an assumed NVLink figure)")
    ap.add_argument("--gpus_per_node", type=int, default=8, help="GPUs per node of the job (default 8)")
    ap.add_argument("--host_cores", type=int,
                    help="CPU cores of the job's node (default: this machine's): the rank runs on its share (cores / "
                         "ranks per node, at most this machine's), as its CPU Adam will, and the plan counts the same")
    ap.add_argument("--gpus_per_host", dest="gpus_per_node", type=int, help=argparse.SUPPRESS)  # plan's old spelling
    ap.add_argument("--internode_gbps", type=float, default=DEFAULT_INTERNODE_GBPS,
                    help=f"network GB/s per GPU for collectives that cross nodes (default {DEFAULT_INTERNODE_GBPS:g}"
                         f" = 400 Gb/s InfiniBand)")
    ap.add_argument("--a2a_hidden", type=float, default=0.0,
                    help="fraction of the Ulysses all-to-all time hidden behind compute (default 0)")
    ap.add_argument("--zero3_hidden", type=float, default=1.0,
                    help="fraction of the compute that ZeRO-3's gathers/reduce-scatters hide behind (default 1)")
    ap.add_argument("--a2a_stall_s_per_gb", type=float, default=A2A_STALL_S_PER_GB,
                    help=f"seconds a real run stalls per GB of all-to-all input per rank, beyond the wire time "
                         f"(default {A2A_STALL_S_PER_GB:g}, calibrated on real sp=2 runs on 2 H200s)")
    ap.add_argument("--collective_fill", choices=FILLS, default="local",
                    help="what collectives leave in their outputs: local = this rank's own values (default), "
                         "none = the fake group's untouched buffers (kernels run faster on them: comparison only)")
    ap.add_argument("--count_collectives", action="store_true",
                    help="run one more (untimed, slower) step that records every collective issued, to set "
                         "beside the model's counts")
    ap.add_argument("--json", action="store_true", help="print the result as JSON after the summary line")
    ap.add_argument("--out", help="also write the JSON result to this file")
    return ap


def _check_args(args: argparse.Namespace) -> None:
    if args.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {args.gpus}")
    if not 0 <= args.rank < args.gpus:
        raise ConfigError(f"--rank {args.rank} is outside the job's ranks 0..{args.gpus - 1}; pick one of those")
    if args.steps < (1 if args.standin else 2):
        raise ConfigError(f"--steps must be >= 2 (the first step is a warm-up, not timed; 1 is enough with "
                          f"--standin), got {args.steps}")
    if args.gpus_per_node < 1:
        raise ConfigError(f"--gpus_per_node must be >= 1, got {args.gpus_per_node}")
    if args.host_cores is not None and args.host_cores < 1:
        raise ConfigError(f"--host_cores must be >= 1, got {args.host_cores}")
    if not args.internode_gbps > 0:
        raise ConfigError(f"--internode_gbps must be > 0, got {args.internode_gbps}")
    for name in ("a2a_hidden", "zero3_hidden"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise ConfigError(f"--{name} must be a fraction in [0, 1], got {getattr(args, name)}")
    if args.a2a_stall_s_per_gb < 0:
        raise ConfigError(f"--a2a_stall_s_per_gb must be >= 0, got {args.a2a_stall_s_per_gb}")
    if args.comm is not None and not os.path.isfile(args.comm):
        raise ConfigError(f"--comm {args.comm}: no such file; give the JSON of benchmarks/comm_bandwidth.py "
                          f"or leave --comm out")
    if args.out is not None and os.path.isdir(args.out):
        raise ConfigError(f"--out {args.out} is a directory; give a file path")


def load_rehearsal_config(args: argparse.Namespace, overrides: list[str]):
    """The recipe + overrides, then what a rehearsal changes: K steps, no eval, no resume, no saving."""
    from .argv import load_config

    cfg = load_config((["--config", args.config] if args.config else []) + overrides)
    # --standin: the plan is resolved (and the model built) with the memory-only kernel in attention's place
    # (on flash-attn-4's path when the run names it: its layers always go group by group)
    kernel = cfg.attn_implementation
    if args.standin:
        kernel = STANDIN_FA4 if cfg.attn_implementation == "flash_attention_4" else STANDIN
    return dataclasses.replace(cfg, max_steps=args.steps, eval_steps=None, eval_strategy="no",
                               resume_from_checkpoint=None, save_steps=None, plot_per_position_loss=False,
                               attn_implementation=kernel)


def rehearse(prepared, opts: Rehearsal, bandwidth, overlap) -> dict[str, Any]:
    """Measure rank opts.rank, add the modelled communication, and return the whole result."""
    from ..plan.comm_model import estimate
    from ..train.metrics import steady_step_s

    measured = run_rehearsal(prepared, opts)
    # the steps after the warm-up, measured as the trainer's end-of-run line measures them
    compute = steady_step_s(measured["step_s"]) + (measured["optimizer_step_s_added"] or 0.0)
    compute_s = None if opts.standin else compute
    # the levers as the rehearsed model ran them (its after-engine plan's tiles and thinning)
    ran = dataclasses.replace(prepared.resolved.levers, tiled_mlp=measured["mlp_tiles"],
                              checkpoint_every=measured["checkpoint_every"])
    job = comm_job(prepared, opts.gpus_per_node, ran)
    comm = estimate(prepared.shape, job, bandwidth, compute_s, overlap)
    predicted = None if compute_s is None else compute_s + comm["comm_s_estimate"]
    tokens = prepared.sequences_per_step * prepared.cfg.max_length  # the whole job's real tokens per step
    return {"status": "ok", "world_size": prepared.world_size, "rank": opts.rank, "sp_size": prepared.sp_size,
            "dp_size": prepared.dp_size, "max_length": prepared.cfg.max_length, "padded_length": prepared.padded_length,
            "local_tokens": job.local_tokens, "model": prepared.cfg.model_name_or_path,
            "attention_kernel": measured["attention_kernel"], "standin": opts.standin, "bf16": prepared.bf16,
            "gpus_per_node": opts.gpus_per_node, "collective_fill": opts.collective_fill,
            "losses_meaningful": False, "note": MEANINGLESS,
            "compute_time_real": not opts.standin, "compute_s": compute_s,
            "compute_s_measured_with_standin": compute if opts.standin else None,
            "warmup_length": opts.warmup_length or prepared.cfg.max_length,
            "comm_s_estimate": comm["comm_s_estimate"], "predicted_step_s": predicted,
            "tokens_per_step": tokens,
            "tokens_per_s_predicted": None if predicted is None else tokens / predicted,
            # every rank of a node holds about what this one does (the same shapes; only the data differs)
            "ranks_per_node": min(prepared.world_size, opts.gpus_per_node),
            "host_cores": prepared.machine.host_cores, "cores_per_rank": opts.cores,
            **measured, "comm": comm}


def summary_line(r: dict[str, Any]) -> str:
    def f(v, unit="", spec=".2f"):
        return "n/a" if v is None else f"{v:{spec}}{unit}"

    kind = "memory only (attention stand-in: time not real)" if r["standin"] else r["attention_kernel"]
    host = (f" ({r['peak_host_job_gb']:.2f} GiB in the job: host stand-in, {r['host_offload_counted_gb']:.2f} "
            f"GiB of offloaded inputs counted, {r['host_offload_held_gb']:.2f} held)" if r.get("host_standin") else "")
    line = (f"[ulysses_trainer] rehearsal rank {r['rank']}/{r['world_size']} (sp {r['sp_size']} x dp {r['dp_size']}"
            f", {r['max_length']:,} tokens, {kind}): peak GPU {f(r['peak_gpu_mem_gb'], ' GiB')}"
            f" (reserved {f(r['peak_gpu_reserved_gb'], ' GiB')}), peak host {f(r['peak_host_mem_gb'], ' GiB')}{host}; "
            f"compute {f(r['compute_s'], ' s')} + comm {f(r['comm_s_estimate'], ' s', '.3f')} (modelled) = "
            f"{f(r['predicted_step_s'], ' s/step')}, {f(r['tokens_per_s_predicted'], ' tokens/s', ',.0f')} "
            f"predicted; collective fill {r['collective_fill']}; losses meaningless")
    if r.get("layer_times"):
        from ..train.layer_times import summary

        line += "\n[ulysses_trainer] " + summary(r["layer_times"])
    counted = r.get("collectives_counted")
    if counted:
        modelled = r["comm"]["by_op"]
        pairs = [f"{op} {counted.get(op, {}).get('bytes', 0) / 2**20:,.1f} MiB ({counted.get(op, {}).get('calls', 0)} "
                 f"calls) vs {m['bytes'] / 2**20:,.1f} MiB ({m['calls']})" for op, m in modelled.items()]
        line += "\n[ulysses_trainer] collectives counted in one step vs modelled: " + "; ".join(pairs)
    return line


def main(argv: list[str] | None = None, around_step=None) -> int:
    """The command; `around_step` (train/rehearsal.py's Rehearsal field) is for a caller that wraps the steps
    (benchmarks/profile_rehearsal.py)."""
    argv = sys.argv[1:] if argv is None else argv
    # as launch/train.py, before CUDA starts: long sequences fragment the caching allocator without this
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    ours, overrides = split_argv(argv, _OWN, _FLAGS)
    use_console()
    try:
        args = _parser().parse_args(ours)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    try:
        from ..plan.comm_model import Overlap, load_bandwidth
        from ..train.prepare import prepare

        _check_args(args)
        cfg = load_rehearsal_config(args, overrides)
        if args.layer_times and cfg.gradient_accumulation_steps > 1:
            raise ConfigError(f"--layer_times times a step of one micro-batch; this run accumulates "
                              f"{cfg.gradient_accumulation_steps}: add --gradient_accumulation_steps 1")
        if args.warmup_length is not None and not 2 <= args.warmup_length <= cfg.max_length:
            raise ConfigError(f"--warmup_length must be between 2 and max_length {cfg.max_length}, "
                              f"got {args.warmup_length}")
        # the rehearsal writes nothing into output_dir
        prepared = prepare(cfg, args.gpus, training=False, host_cores=args.host_cores)
        comm_file = args.comm or (str(DEFAULT_COMM_FILE) if DEFAULT_COMM_FILE.is_file() else None)
        bandwidth = load_bandwidth(comm_file, args.internode_gbps)
    except ConfigError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_INVALID
    print(f"[ulysses_trainer] rehearsal: this process is rank {args.rank} of {args.gpus} (sp {prepared.sp_size} x "
          f"dp {prepared.dp_size}) on torch's fake process group; memory and compute are this rank's, communication "
          f"is modelled ({bandwidth.source}); {MEANINGLESS}", flush=True)
    node_cores = prepared.machine.host_cores or 1  # --host_cores, else this machine's: what the plan counted
    share = max(1, node_cores // min(args.gpus, args.gpus_per_node))  # this rank's cores in the job
    here = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if share > here:
        print(f"[ulysses_trainer] rehearsal note: a rank of the job has {share} CPU cores ({node_cores} per node); "
              f"this machine gives it {here}, so its CPU work (Adam on the host) is timed slower than the job's",
              flush=True)
    opts = Rehearsal(rank=args.rank, steps=args.steps, standin=args.standin, host_standin=args.host_standin,
                     layer_times=args.layer_times, gpus_per_node=args.gpus_per_node,
                     count_collectives=args.count_collectives, warmup_length=args.warmup_length,
                     collective_fill=args.collective_fill, around_step=around_step, cores=min(share, here))
    try:
        with warnings.catch_warnings():
            # DeepSpeed calls torch's older collective names, and each call would print a deprecation warning
            warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated",
                                    category=FutureWarning)
            result = rehearse(prepared, opts, bandwidth, Overlap(a2a_hidden=args.a2a_hidden,
                                                             zero3_hidden=args.zero3_hidden,
                                                             a2a_stall_s_per_gb=args.a2a_stall_s_per_gb))
    except Exception as exc:
        # torch's, or the trainer's own while it builds the model and the engine (train/out_of_memory.OutOfGpuMemory)
        if type(exc).__name__ not in ("OutOfMemoryError", "OutOfGpuMemory"):
            if isinstance(exc, TrainerError):  # e.g. host RAM for offload, found once the engine exists: its line
                print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
                return exc.exit_code
            traceback.print_exc()
            return EXIT_FAILURE
        result = _out_of_memory(prepared, opts, exc)  # a result too: this length does not fit this rank
        print(f"[ulysses_trainer] rehearsal rank {opts.rank}/{prepared.world_size}: out of GPU memory at "
              f"{prepared.cfg.max_length:,} tokens ({result['error']})", file=sys.stderr, flush=True)
        _write(args.out, result)
        return EXIT_FAILURE
    print(summary_line(result), flush=True)
    _write(args.out, result)
    if args.json:
        print(json.dumps(result, indent=1), flush=True)
    return EXIT_OK


def _out_of_memory(prepared, opts: Rehearsal, exc: Exception) -> dict[str, Any]:
    from ..train.metrics import peak_gpu_mem_gb, peak_host_mem_gb

    return {"status": "oom", "error": str(exc).splitlines()[0][:300], "world_size": prepared.world_size,
            "rank": opts.rank, "sp_size": prepared.sp_size, "dp_size": prepared.dp_size,
            "max_length": prepared.cfg.max_length,
            "standin": opts.standin, "losses_meaningful": False, "compute_s": None, "comm_s_estimate": None,
            "predicted_step_s": None, "tokens_per_s_predicted": None, "peak_gpu_mem_gb": peak_gpu_mem_gb(),
            "peak_host_mem_gb": peak_host_mem_gb()}


def _write(path: str | None, result: dict[str, Any]) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(json.dumps(result, indent=1) + "\n")
    os.replace(path + ".tmp", path)
