"""`ulysses-trainer plan`: predict a run's memory and choose the cheapest settings that fit.

    ulysses-trainer plan --config RECIPE.yaml --gpus 8 --gpu_memory_gb 80 [--host_memory_gb 1000] [--json]
    ulysses-trainer plan --model qwen3-8b --max_length 1048576 --gpus 8 --gpu_memory_gb 80 \
        --host_memory_gb 1000 [--sp 8]
    ulysses-trainer plan calibrate [--results_dir benchmarks/results] [--json]

Any other `--name value` is a training-config override (as for launch/train.py), e.g.
`--tiled_mlp 8 --activation_offload 4 --loss_type nll --per_device_train_batch_size 2`. Levers left at
`auto` are chosen by the search; fixed ones are planned as given. Memory is in GiB (2**30 bytes).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from ..errors import EXIT_INVALID, EXIT_OK, ConfigError
from .memory import GIB, MemoryEstimate, ModelShape, Settings, Zero3Knobs, kept_attention_bytes_per_layer, local_tokens
from .search import Choice, Hardware, choose_settings, largest_max_length

_OWN = {"config", "model", "gpus", "gpu_memory_gb", "host_memory_gb", "sp", "gpus_per_host", "json",
        "offload_optimizer", "results_dir", "help"}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ulysses-trainer plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="a training recipe (YAML)")
    ap.add_argument("--model", help="preset or checkpoint dir (= model_name_or_path)")
    ap.add_argument("--gpus", type=int, help="GPUs in all (default: the recipe's sp_size, else 1)")
    ap.add_argument("--gpu_memory_gb", type=float, help="memory per GPU, GiB (default: this machine's GPU)")
    ap.add_argument("--host_memory_gb", type=float,
                    help="host RAM per host, GiB (default: the recipe's host_memory_gb, else detected)")
    ap.add_argument("--gpus_per_host", type=int, help="GPUs sharing one host's RAM (default: all)")
    ap.add_argument("--sp", type=int, help="sequence-parallel degree (= sp_size; default: --gpus)")
    ap.add_argument("--offload_optimizer", choices=["auto", "true", "false"], default=None,
                    help="ZeRO-Offload of the optimizer states (default: the ZeRO JSON's setting when the "
                         "recipe names one, else auto = only if nothing fits without it)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return ap


def _split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(our flags, training-config overrides): `--name value` pairs whose name is not ours go to the config."""
    ours, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        name = arg[2:].split("=", 1)[0].replace("-", "_") if arg.startswith("--") else None
        takes_value = "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--")
        bucket = ours if (name in _OWN or not arg.startswith("--")) else rest
        bucket.append(arg)
        if takes_value and name != "json":
            bucket.append(argv[i + 1])
            i += 1
        i += 1
    return ours, rest


def _ds_settings(ds_path: Any) -> tuple[bool, Zero3Knobs]:
    """(optimizer offloaded?, bucket sizes) from the run's ZeRO JSON; only stage 3 is planned."""
    from ..ds_config import load_ds_config

    ds = load_ds_config(ds_path)
    zero = ds.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0)
    if stage != 3:
        raise ConfigError(f"the ZeRO config {ds_path} has stage {stage}; the planner (and the trainer) use "
                          f"stage 3: set zero_optimization.stage 3")
    off = zero.get("offload_optimizer")
    offload = isinstance(off, dict) and off.get("device", "none") not in ("none", None)

    def num(key: str) -> int | None:
        v = zero.get(key, "auto")
        return None if v == "auto" else int(float(v))

    sub = num("sub_group_size")
    knobs = Zero3Knobs(reduce_bucket_size=num("reduce_bucket_size"),
                       prefetch_bucket_size=num("stage3_prefetch_bucket_size"),
                       param_persistence_threshold=num("stage3_param_persistence_threshold"),
                       sub_group_size=sub if sub is not None else 1_000_000_000)
    return offload, knobs


def _default_gpu_memory_gb() -> float:
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("no CUDA device here to read the GPU memory from: pass --gpu_memory_gb "
                          "(per-GPU memory in GiB, e.g. 80 for an 80 GB H100, 139 for an H200)")
    return torch.cuda.get_device_properties(0).total_memory / GIB


def _lever(value: Any, name: str, layers: int) -> int | None:
    """A recipe lever -> fixed int, or None for auto."""
    if value == "auto":
        return None
    if value is False:
        return 0 if name == "activation_offload" else 1
    if value is True:
        return layers if name == "activation_offload" else -1  # -1: the trainer's own tile count
    return int(value)


def _kept_layers(value: Any, layers: int) -> int:
    if value is True:
        return layers
    return 0 if value in (False, "auto") else int(value)


def build_plan_inputs(argv: list[str]) -> tuple[ModelShape, Settings, Hardware, dict[str, Any], str]:
    """Parse the command line into (shape, base settings, hardware, fixed levers, model name)."""
    from ..config import build_config, parse_argv, read_recipe, validate_config
    from ..model.load import model_config_for

    ours, rest = _split_argv(argv)
    args = _parser().parse_args(ours)
    _, overrides = parse_argv(rest)
    recipe = read_recipe(args.config) if args.config else {}
    if args.model:
        overrides["model_name_or_path"] = args.model
    if args.sp is not None:
        overrides["sp_size"] = args.sp
    if not args.config and "max_length" not in overrides:
        raise ConfigError("pass --max_length N (tokens per sequence) or a recipe with --config")
    cfg = build_config(recipe, overrides, recipe_name=f"recipe {args.config}" if args.config else "recipe")
    gpus = args.gpus if args.gpus is not None else (cfg.sp_size or 1)
    if gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {gpus}")
    validate_config(cfg, gpus)
    sp = cfg.sp_size or gpus
    config = model_config_for(cfg)
    shape = ModelShape.from_config(config)
    offload_opt, knobs = _ds_settings(cfg.deepspeed)
    if "deepspeed" not in recipe and "deepspeed" not in overrides:
        offload_opt = None  # no ZeRO JSON chosen: the planner may pick ds_configs/zero3_offload.json
    if args.offload_optimizer is not None:
        offload_opt = None if args.offload_optimizer == "auto" else args.offload_optimizer == "true"
    host = args.host_memory_gb or cfg.host_memory_gb
    if host is None:
        from ..levers.host_pool import detect_host_memory_gb

        host = detect_host_memory_gb()
    hw = Hardware(gpus=gpus, gpu_memory_gb=args.gpu_memory_gb or _default_gpu_memory_gb(), host_memory_gb=host,
                  gpus_per_host=args.gpus_per_host)
    hw.check()
    base = Settings(max_length=cfg.max_length, sp=sp, dp=gpus // sp, micro_batch=cfg.per_device_train_batch_size,
                    bf16=cfg.bf16 is not False, gradient_checkpointing=cfg.gradient_checkpointing,
                    loss_type=cfg.loss_type, loss_chunk_size=cfg.loss_chunk_size, lean_norm=cfg.lean_norm,
                    # "auto" keeps what fits once the run knows its free memory: planned as none
                    kept_attention_layers=_kept_layers(cfg.keep_attention_outputs, shape.layers),
                    attention="sdpa" if cfg.attn_implementation == "auto" else cfg.attn_implementation,
                    pad_to_multiple_of=cfg.pad_to_multiple_of, zero3=knobs, gpus_per_host=hw.gpus_per_host)
    tiles = _lever(cfg.tiled_mlp, "tiled_mlp", shape.layers)
    if tiles == -1:
        from ..levers.tiled_mlp import auto_num_tiles

        tiles = auto_num_tiles(local_tokens(base), shape.hidden, shape.intermediate)
    fixed = {"offload_layers": _lever(cfg.activation_offload, "activation_offload", shape.layers),
             "tiles": tiles, "offload_optimizer": offload_opt,
             # left unset (recipe and command line), the search may thin the checkpoints when nothing else fits
             "every": cfg.checkpoint_every if "checkpoint_every" in recipe or "checkpoint_every" in overrides
             else None}
    return shape, base, hw, fixed, cfg.model_name_or_path


def _gb(b: int) -> str:
    return f"{b / GIB:8.2f}" if b else f"{'-':>8}"


def format_estimate(e: MemoryEstimate) -> str:
    """The term table: GPU GiB (per GPU) and host GiB (per rank), the peak phase marked."""
    s = e.settings
    lines = [f"{'term':<52} {'GPU GiB':>8} {'host GiB':>8}  phase", "-" * 80]
    for t in e.terms:
        if not t.gpu and not t.host:
            continue
        mark = "" if e.counts(t) or not t.gpu else "  (not at the peak)"
        lines.append(f"{t.name[:52]:<52} {_gb(t.gpu)} {_gb(t.host)}  {t.phase}{mark}")
    lines.append("-" * 80)
    lines.append(f"{'GPU peak allocated (' + e.peak_phase.replace('_', ' ') + ')':<52} {_gb(e.gpu_peak)}")
    lines.append(f"{'GPU needed (peak + slack + context)':<52} {_gb(e.gpu_required)}")
    lines.append(f"{'host per rank':<52} {'':>8} {_gb(e.host_per_rank)}")
    lines.append(f"{f'host per host ({s.ranks_per_host} ranks)':<52} {'':>8} {_gb(e.host_per_host)}")
    return "\n".join(lines)


def _settings_summary(s: Settings) -> dict[str, Any]:
    return {"max_length": s.max_length, "sp_size": s.sp, "dp": s.dp, "activation_offload": s.activation_offload,
            "tiled_mlp": s.tiled_mlp if s.tiled_mlp > 1 else False, "offload_optimizer": s.offload_optimizer,
            "checkpoint_every": s.checkpoint_every, "loss_type": s.loss_type, "loss_chunk_size": s.loss_chunk_size}


def run_plan(argv: list[str]) -> int:
    shape, base, hw, fixed, model = build_plan_inputs(argv)
    choice = choose_settings(shape, base, hw, **fixed)
    longest, best = largest_max_length(shape, base, hw, **fixed)
    if "--json" in argv:
        out = {"model": model, "hardware": hw.__dict__, "fits": choice.fits,
               "chosen": _settings_summary(choice.settings), "estimate": choice.estimate.to_dict(),
               "largest_max_length": longest,
               "largest_settings": _settings_summary(best.settings) if best else None}
        print(json.dumps(out, indent=1))
        return EXIT_OK
    print(_report(model, hw, choice, longest, best))
    return EXIT_OK


def _report(model: str, hw: Hardware, choice: Choice, longest: int, best: Choice | None) -> str:
    s, e = choice.settings, choice.estimate
    head = (f"{model}, max_length {s.max_length:,}, {hw.gpus} GPU(s) x {hw.gpu_memory_gb:g} GiB, "
            f"host {hw.host_memory_gb:g} GiB, sp {s.sp} x dp {s.dp}, {local_tokens(s):,} tokens per GPU")
    verdict = "fits" if choice.fits else "DOES NOT FIT (the settings that come closest are shown)"
    chosen = _settings_summary(s)
    lines = [head, "", format_estimate(e), "",
             f"{verdict}: " + ", ".join(f"{k} {v}" for k, v in chosen.items() if k != "max_length")]
    if choice.fits:
        lines.append("recipe lines: " + "; ".join([f"activation_offload: {s.activation_offload}",
                                                   f"tiled_mlp: {s.tiled_mlp if s.tiled_mlp > 1 else 'false'}"]
                                                  + ([f"checkpoint_every: {s.checkpoint_every}"]
                                                     if s.checkpoint_every > 1 else [])
                                                  + (["deepspeed: ds_configs/zero3_offload.json"]
                                                     if s.offload_optimizer else [])))
    if s.checkpoint_every > 1:
        lines.append(_rebuild_cost(s.checkpoint_every))
    if choice.fits and s.gradient_checkpointing and s.kept_attention_layers == 0:
        lines.extend(_kept_outputs_room(e, hw))
    if best is not None:
        b = best.settings
        lines.append(f"largest max_length that fits: {longest:,} (activation_offload {b.activation_offload}, "
                     f"tiled_mlp {b.tiled_mlp}, offload_optimizer {b.offload_optimizer}, "
                     f"checkpoint_every {b.checkpoint_every}; "
                     f"searched in multiples of {1024 * b.sp:,})")
    else:
        lines.append("largest max_length that fits: none (not even 1024 x sp tokens)")
    return "\n".join(lines)


def _kept_outputs_room(e: MemoryEstimate, hw: Hardware) -> list[str]:
    """How many layers `keep_attention_outputs: auto` could keep in what the plan leaves free."""
    per = kept_attention_bytes_per_layer(e.shape, e.settings) * (1 + e.settings.allocator_slack)
    room = hw.gpu_memory_gb * GIB - e.gpu_required
    n = int(min(e.shape.layers, max(0, room) // per))
    if n == 0:
        return []
    return [f"keep_attention_outputs: auto would keep about {n} of {e.shape.layers} layers' attention outputs "
            f"in the {room / GIB:.1f} GiB left ({per / GIB:.2f} GiB each; their recompute skips the attention "
            "forward)"]


def _rebuild_cost(every: int) -> str:
    """What checkpoint_every costs in compute: a checkpointed step runs each layer's forward twice and its
    backward (~2 forwards) once, ~4 forwards; rebuilding adds one for (k-1)/k of the layers."""
    extra = (every - 1) / every
    return (f"checkpoint_every {every}: {extra:.0%} of the layers run forward once more in backward "
            f"(about +{extra / 4:.0%} step compute)")


def run_calibrate(argv: list[str]) -> int:
    from .calibration import compare, format_comparison, load_calibration, load_measurements

    ap = argparse.ArgumentParser(prog="ulysses-trainer plan calibrate",
                                 description="predicted vs measured peak memory")
    ap.add_argument("--results_dir", default="benchmarks/results",
                    help="where benchmarks/long_context.py wrote long_context_*.json")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = compare(load_calibration() + load_measurements(args.results_dir))
    if args.json:
        print(json.dumps([{"source": c.measurement.source, "system": c.measurement.system,
                           "model": c.measurement.model, "seq_len": c.measurement.settings.max_length,
                           "attention": c.measurement.attention,
                           "measured_gpu_gb": c.measurement.peak_gpu_gb, "predicted_gpu_gb": c.predicted_gpu_gb,
                           "gpu_error": c.gpu_error, "measured_host_gb": c.measurement.peak_host_gb,
                           "predicted_host_gb": c.predicted_host_gb,
                           "host_error": None if c.host_error is None or math.isnan(c.host_error) else c.host_error}
                          for c in rows], indent=1))
    else:
        print(format_comparison(rows))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Entry of the `plan` subcommand; ConfigError -> one line on stderr, exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] == "calibrate":
            return run_calibrate(argv[1:])
        return run_plan(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID

