"""`ulysses-trainer plan`: the plan the trainer would run (plan/resolve.py), its memory and step time.

    ulysses-trainer plan --config RECIPE.yaml --gpus 8 --gpu_memory_gb 80 [--host_memory_gb 1000] [--json]
    ulysses-trainer plan --model qwen3-8b --max_length 1048576 --gpus 8 --gpu_memory_gb 80 \
        --host_memory_gb 1000 [--sp_size 8] --model_init_kwargs '{rope_parameters: {rope_type: yarn, factor: auto}}'
    ulysses-trainer plan calibrate [--results_dir benchmarks/results] [--json]

Any other `--name value` is a training-config override (as for launch/train.py), e.g.
`--tiled_mlp 8 --activation_offload 4 --loss_type nll --per_device_train_batch_size 2`. Levers left at
`auto` are chosen by the search (the fastest predicted step that fits); fixed ones are planned as given.
With `packing: true` and a dataset (`dataset_name` in the recipe or `--dataset_name ...`) the plan builds the
training sequences as the trainer does (all of them) and times attention from the real documents of the rows its
max_steps (else its epochs) train, in its order (sum of l_i^2, causal varlen; pads cost none); without data it
times one document of max_length, the worst case, and
says so. Memory is in GiB (2**30 bytes). Exit 0: it fits; 1: it does not (the binding limit and the missing GiB
are named); 2: invalid input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from .. import probe  # read through the module: its functions are the test seam
from ..config import REPO_ROOT, validate_config
from ..config.load import build_config, read_recipe
from ..ds_config import load_ds_config, zero_config_for
from ..errors import EXIT_FAILURE, EXIT_INVALID, EXIT_OK, ConfigError
from ..model.load import model_config_for
from ..plan.attention_share import AttentionShare, timed_from_data
from ..plan.cards import CARDS, card_of
from ..plan.inputs import ModelShape
from ..plan.longest_fit import Hardware, largest_max_length
from ..plan.resolve import plan_from, search_plan
from ..plan.types import Machine, Plan, read_zero
from .argv import parse_overrides, split_argv
from .console import use_console
from .plan_report import floor_of, hardware_json, settings_summary, shortage, text_report

_FLAGS = {"json", "help"}  # take no value
_ALIASES = {"sp", "gpus_per_host"}  # earlier spellings of --sp_size, --gpus_per_node: scripts keep working
_OWN = {"config", "model", "gpus", "gpu", "gpu_memory_gb", "host_memory_gb", "host_cores", "sp_size", "gpus_per_node",
        "offload_optimizer",
        "results_dir", *_FLAGS, *_ALIASES}



def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ulysses-trainer plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="a training recipe (YAML)")
    ap.add_argument("--model", help="preset or checkpoint dir (= model_name_or_path)")
    ap.add_argument("--gpus", type=int, help="GPUs in all (default: the recipe's sp_size, else 1)")
    ap.add_argument("--gpu_memory_gb", type=float,
                    help="memory per GPU, GiB (default: this machine's GPU, or the --gpu card's)")
    ap.add_argument("--gpu", choices=sorted(CARDS),
                    help="the card of the machine planned (its measured rates, its memory unless --gpu_memory_gb; "
                         "default: this machine's)")
    ap.add_argument("--host_memory_gb", type=float,
                    help="host RAM per host, GiB (default: the recipe's host_memory_gb; detected when planning "
                         "for this machine; for another machine 2 x GPU memory per GPU is assumed, and said)")
    ap.add_argument("--gpus_per_node", type=int, help="GPUs per node, sharing its RAM (default: all)")
    ap.add_argument("--host_cores", type=int,
                    help="CPU cores per node, shared by its ranks' CPU Adam (default: this machine's when it is the "
                         "one planned, else 16 per GPU)")
    ap.add_argument("--gpus_per_host", dest="gpus_per_node", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--sp_size", type=int, help="sequence-parallel degree (default: --gpus)")
    ap.add_argument("--sp", dest="sp_size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--offload_optimizer", choices=["auto", "true", "false"], default=None,
                    help="= optimizer_offload: Adam on the host (ZeRO-Offload); an offload_optimizer section "
                         "in the ZeRO JSON wins; auto = where it makes the step faster")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return ap


def _host_memory(args: argparse.Namespace, cfg: Any, gpus: int, gpu_gb: float, here: bool) -> tuple[float, str]:
    """(host RAM per host in GiB, where it comes from). Detected only when planning for this machine; for
    another machine (--gpus or --gpu_memory_gb other than this one's) an assumption that the plan states."""
    if args.host_memory_gb is not None:
        return args.host_memory_gb, "--host_memory_gb"
    if cfg.host_memory_gb is not None or here:
        return probe.host_memory(cfg.host_memory_gb)
    per_host = args.gpus_per_node or gpus
    return ASSUMED_HOST_PER_GPU * gpu_gb * per_host, (
        f"ASSUMED: {ASSUMED_HOST_PER_GPU:g} x GPU memory per GPU of a host, as typical GPU servers have; pass "
        f"--host_memory_gb for the real figure")


ASSUMED_HOST_PER_GPU = 2.0  # host RAM per GiB of GPU memory assumed for a machine that is not this one
# planning another machine: its installed kernels are unknown, so auto plans the first (and says so)
ELSEWHERE_KERNELS = ("sdpa", "flash_attention_4", "flash_attention_2")
ELSEWHERE_NORM_KERNELS = ("torch", "triton")
ELSEWHERE_DELTANET_KERNELS = ("torch", "fla")  # auto: the first (said in a note); a named one is taken


def build_plan_inputs(argv: list[str]) -> tuple[Any, Any, dict, Machine, argparse.Namespace]:
    """Parse the command line into (training config, HF model config, ZeRO JSON, machine, our flags)."""
    ours, rest = split_argv(argv, _OWN, _FLAGS)
    args = _parser().parse_args(ours)
    _, overrides = parse_overrides(rest)
    recipe = read_recipe(args.config) if args.config else {}
    if args.model:
        overrides["model_name_or_path"] = args.model
    if args.sp_size is not None:
        overrides["sp_size"] = args.sp_size
    if args.offload_optimizer is not None:
        overrides["optimizer_offload"] = {"auto": "auto", "true": True, "false": False}[args.offload_optimizer]
    if not args.config and "max_length" not in overrides:
        raise ConfigError("pass --max_length N (tokens per sequence) or a recipe with --config")
    cfg = build_config(recipe, overrides, recipe_name=f"recipe {args.config}" if args.config else "recipe")
    local = probe.local_gpus()
    local_gb = local.memory_gb
    gpus = args.gpus if args.gpus is not None else (cfg.sp_size or 1)
    if gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {gpus}")
    validate_config(cfg, gpus)
    card = CARDS[args.gpu] if args.gpu else None
    same_card = card is None or card_of(local.name) == card.name
    gpu_gb = args.gpu_memory_gb if args.gpu_memory_gb is not None else \
        local_gb if same_card else card.memory_gb
    model_config = model_config_for(cfg)
    ds = load_ds_config(cfg.deepspeed)
    if gpu_gb is None:  # no GPU here and none named: this machine's CPU run, planned as the trainer plans it
        machine = probe.this_machine(gpus, args.host_memory_gb if args.host_memory_gb is not None
                                     else cfg.host_memory_gb)
        if args.gpus_per_node is not None:
            machine = replace(machine, gpus_per_node=args.gpus_per_node)
        if args.host_memory_gb is not None:
            machine = replace(machine, host_memory_source="--host_memory_gb")
        return cfg, model_config, ds, machine, args
    here = local_gb is not None and same_card and (args.gpus is None or args.gpus <= local.count) and \
        (args.gpu_memory_gb is None or abs(args.gpu_memory_gb - local_gb) < 0.5)
    host, source = _host_memory(args, cfg, gpus, gpu_gb, here)
    kernels, norms = probe.installed_kernels() if here else (ELSEWHERE_KERNELS, ELSEWHERE_NORM_KERNELS)
    deltanet = probe.installed_deltanet_kernels() if here else ELSEWHERE_DELTANET_KERNELS
    machine = Machine(gpus=gpus, gpu_memory_gb=gpu_gb, host_memory_gb=host, gpus_per_node=args.gpus_per_node,
                      kernels=kernels, kernels_known=here, norm_kernels=norms, deltanet_kernels=deltanet,
                      gpu_name=local.name if here else card.name if card else None,
                      host_memory_source=source, bf16_supported=local.bf16 if here else True,
                      host_cores=args.host_cores or (os.cpu_count() if here else None))
    return cfg, model_config, ds, machine, args


def run_plan(argv: list[str]) -> int:
    """`ulysses-trainer plan`: the plan the trainer would run (the same search_plan and plan_from), then the longest
    max_length that fits. Exit 0 when it fits, 1 when it does not (the binding limit is named), 2 for what the
    trainer refuses (the ZeRO JSON checked against the config as the trainer checks it)."""
    # stdout holds the report only: what libraries log on their import (DeepSpeed's accelerator line) goes to stderr
    with contextlib.redirect_stdout(sys.stderr):
        cfg, model_config, ds, machine, args = build_plan_inputs(argv)

        def checked(plan: Plan) -> Plan:
            # the trainer's own check of the JSON against the config and the plan (train/prepare.py): the same
            # refusals, before the data is read
            zero_config_for(ds, cfg, plan, machine.gpus, device_is_cuda=machine.gpu_memory_gb is not None,
                            hidden_size=model_config.hidden_size, source=str(cfg.deepspeed),
                            total_steps=cfg.max_steps)
            return plan

        # the trainer's own steps (train/prepare.py): one search, its plan without the data, then the same search
        # timed with the packed rows' attention
        shape = ModelShape.from_config(model_config)
        search = search_plan(cfg, shape, machine, read_zero(ds, str(cfg.deepspeed)))
        plan = checked(plan_from(search))
        attention = data_attention(cfg, machine.gpus, model_config)
        if attention is not None:
            plan = checked(plan_from(search, attention=attention))
    hw = Hardware(machine.gpus, machine.gpu_memory_gb, machine.host_memory_gb, machine.gpus_per_node)
    # the plan's layout, kernels and loss, none of its length-dependent choices: the longest does not depend
    # on the max_length asked (the ZeRO-3 sizes per placement as the plan's own search had them)
    knobs = plan.zero.by_placement
    base = replace(plan.run.with_levers(activation_offload=0, keep_attention_outputs=0), max_length=cfg.max_length,
                   zero3=knobs[False])
    # Adam's placement as the config and the ZeRO JSON fixed it (lever_settings: decode_levers, with_json_placement)
    longest, best = (largest_max_length(shape, base, hw, optimizer_offload=plan.fixed.optimizer_offload, knobs=knobs)
                     if machine.gpu_memory_gb is not None else (None, None))  # a CPU run: no GPU memory to fill
    floor = floor_of(plan)
    if args.json:
        out = {"model": plan.model, "hardware": hardware_json(machine),
               "fits": plan.predicted.fits, "plan": plan.to_dict(), "chosen": settings_summary(plan.run),
               "estimate": plan.predicted.estimate.to_dict(), "largest_max_length": longest,
               "largest_settings": settings_summary(best.settings) if best else None}
        if floor is not None and shape.mixer_layers:  # Qwen3.5; Qwen3's JSON is held byte-equal (text only)
            out["step_floor"] = floor
        print(json.dumps(out, indent=1))
    else:
        print(text_report(plan, machine, longest, best, floor))
    if not plan.predicted.fits:
        print(f"error: does not fit: {shortage(plan)}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def data_attention(cfg: Any, gpus: int, model_config: Any) -> AttentionShare | None:
    """The packed data's attention cost, from the rows the trainer trains: all the sequences it builds, then the
    rows of its max_steps (else its epochs) in its order (train/prepare.data_share, the trainer's own function);
    None without packing or without a dataset (the plan then times one document per row)."""
    if not timed_from_data(cfg):
        return None
    from ..data.documents import build_sequences
    from ..data.order import steps_of
    from ..data.tokenizer import apply_tokenizer_options, family_vocabulary, load_tokenizer
    from ..families import family
    from ..model.load import checkpoint_source
    from ..train.prepare import data_share
    from ..vocabulary.layout import resolve_layout

    dp_size = resolve_layout(cfg.sp_size, gpus).dp_size
    per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * dp_size
    vocabulary = family_vocabulary(family(model_config.model_type), model_config)
    tokenizer = apply_tokenizer_options(load_tokenizer(checkpoint_source(cfg.model_name_or_path), vocabulary),
                                        cfg.chat_template_path, cfg.eos_token)
    data = build_sequences(cfg, tokenizer, split="train", dp_size=dp_size)  # the whole dataset, as the trainer reads it
    return data_share(data, cfg.seed, per_step, steps_of(cfg.max_steps, cfg.num_train_epochs, len(data), per_step))


def run_calibrate(argv: list[str]) -> int:
    from ..plan.calibration import compare, format_comparison, load_calibration, load_measurements

    ap = argparse.ArgumentParser(prog="ulysses-trainer plan calibrate",
                                 description="predicted vs measured peak memory")
    ap.add_argument("--results_dir", default=None,
                    help="where benchmarks/long_context.py wrote long_context_*.json (default: a checkout's "
                         "benchmarks/results)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    results = Path(args.results_dir or "benchmarks/results")
    if not results.is_dir() and args.results_dir is None:  # run outside a checkout: the repo's own folder
        results = REPO_ROOT / "benchmarks" / "results"
    shipped = load_calibration()
    if not results.is_dir():
        if args.results_dir is not None:
            raise ConfigError(f"--results_dir {args.results_dir}: no such directory; give the folder holding "
                              f"benchmarks/long_context.py's long_context_*.json")
        # an installed package ships plan/calibration.json, not the checkout's benchmark results: say so
        print(f"note: no benchmarks/results here (an installed package ships only plan/calibration.json): "
              f"{len(shipped)} shipped points, without the long_context_*.json measurements a checkout's "
              f"benchmarks/results holds; run it in a checkout of the repository or pass --results_dir",
              file=sys.stderr)
    rows = compare(shipped + (load_measurements(results) if results.is_dir() else []))
    if args.json:
        print(json.dumps([{"source": c.measurement.source, "system": c.measurement.system,
                           "model": c.measurement.model, "seq_len": c.measurement.settings.max_length,
                           "attention": c.measurement.settings.attn_implementation,
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
    use_console()
    try:
        if argv and argv[0] == "calibrate":
            return run_calibrate(argv[1:])
        return run_plan(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID

