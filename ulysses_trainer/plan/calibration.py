"""Measured peaks next to the memory model's predictions.

Two sources:
- plan/calibration.json (in the repo): measured points with the settings that ran, each labelled
  with where it comes from;
- benchmarks/results/long_context_*.json (benchmarks/long_context.py output), read by
  `load_measurements`, which rebuilds each system's settings from the file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..vocabulary.layout import Layout
from ..vocabulary.lever_settings import LEVER_FIELDS
from ..vocabulary.names import DEFAULT_SUB_GROUP_SIZE, GIB, PLANNED_KERNELS, STANDIN, STANDINS, auto_num_tiles
from .inputs import ModelShape, Settings, Zero3Knobs
from .memory import estimate

CALIBRATION_FILE = Path(__file__).with_name("calibration.json")
SYSTEMS = ("ours", "alst", "hf")
# benchmarks/long_context.py leaves these ZeRO-3 sizes unset: DeepSpeed's defaults apply
DEEPSPEED_DEFAULT_KNOBS = Zero3Knobs(reduce_bucket_size=500_000_000, prefetch_bucket_size=50_000_000,
                                     param_persistence_threshold=100_000, sub_group_size=DEFAULT_SUB_GROUP_SIZE)


@dataclass(frozen=True)
class Measurement:
    """One measured step: what ran (model + Settings) and the peaks it reached (GiB)."""

    source: str
    system: str
    model: str
    shape: ModelShape
    settings: Settings
    peak_gpu_gb: float
    peak_host_gb: float | None = None
    note: str = ""
    # set (why) where the model is known to over-predict this point, i.e. to err on the safe side
    over_predicted: str = ""


def settings_from_dict(d: dict[str, Any]) -> Settings:
    """Settings from JSON, the levers under their own names (Settings.flat's keys; unknown keys are an error, so a
    typo cannot silently change a prediction)."""
    known = ({f.name for f in fields(Settings)} - {"levers", "layout"}) | {"sp_size", "dp_size"} | set(LEVER_FIELDS)
    bad = sorted(set(d) - known)
    if bad:
        raise ConfigError(f"calibration settings have unknown keys {bad}; known: {sorted(known)}")
    d = dict(d)
    if isinstance(d.get("zero3"), dict):
        d["zero3"] = Zero3Knobs(**d["zero3"])
    sp, dp = d.pop("sp_size", 1), d.pop("dp_size", 1)
    d["layout"] = Layout(sp * dp, sp)
    return Settings(**{k: v for k, v in d.items() if k not in LEVER_FIELDS}).with_levers(
        **{k: v for k, v in d.items() if k in LEVER_FIELDS})


def load_calibration(path: str | Path = CALIBRATION_FILE) -> list[Measurement]:
    """The measured points stored in the repository."""
    data = json.loads(Path(path).read_text())
    out = []
    for m in data["measurements"]:
        shape = replace(ModelShape.preset(m["model"]), **m.get("model_overrides", {}))
        out.append(Measurement(source=m["source"], system=m["system"], model=m["model"], shape=shape,
                               settings=settings_from_dict({"lean_norm": False, "grouped_attention": False,
                                                            **m["settings"]}),
                               peak_gpu_gb=m["peak_gpu_gb"],
                               peak_host_gb=m.get("peak_host_gb"),
                               note=m.get("note", ""), over_predicted=m.get("over_predicted", "")))
    return out


def benchmark_settings(system: str, shape: ModelShape, point: dict[str, Any], steps: int,
                       mode: str = "train") -> Settings:
    """The Settings that benchmarks/long_context.py ran for `system` at one point: one GPU, bf16, and
    in mode "train" ZeRO-3 with fused torch AdamW (after one step Adam's m, v do not exist yet during
    forward/backward; with the memory-only attention stand-in the gradients are not finite and
    DeepSpeed skips every step, so they never do: observed on the H200), in mode "fwdbwd" no engine
    and no optimizer (bf16 weights and grads)."""
    if system not in SYSTEMS:
        raise ConfigError(f"unknown system {system!r} in a results file; expected one of {SYSTEMS}")
    length = int(point["seq_len"])
    attention = point.get("attention") or "sdpa"
    if attention not in PLANNED_KERNELS:
        attention = STANDIN if "standin" in attention else "sdpa"
    first = point.get("first_step", steps < 2 or attention in STANDINS)
    base = Settings(max_length=length, attn_implementation=attention, first_step=first, lean_norm=False,
                    grouped_attention=False, zero3=DEEPSPEED_DEFAULT_KNOBS)
    if mode == "fwdbwd":
        base = replace(base, zero_stage=0, optimizer="none")
    if system == "ours":
        # points measured before lean norms existed carry no "lean_norm" key: HF norms
        levers = base.with_levers(activation_offload=int(point.get("offloaded_layers") or 0),
                                  keep_attention_outputs=int(point.get("kept_attention_layers", 0)),
                                  checkpoint_every=int(point.get("checkpoint_every", 1)),
                                  optimizer_offload=bool(point.get("offload_optimizer", False)),
                                  tiled_mlp=auto_num_tiles(length, shape.hidden, shape.mlp_row_width))
        return replace(levers, lean_norm=bool(point.get("lean_norm", False)),
                       grouped_attention=bool(point.get("grouped_attention", False)),
                       # long_context.py sets smaller sub-groups with optimizer offload (2**28 in the first
                       # runs, which did not record it)
                       zero3=replace(DEEPSPEED_DEFAULT_KNOBS, sub_group_size=int(point.get("sub_group_size", 2**28)))
                       if point.get("offload_optimizer") else DEEPSPEED_DEFAULT_KNOBS)
    if system == "alst":  # every checkpoint offloaded per tensor (pinned, power-of-two), no prefetch;
        # DeepSpeed TiledMLP with ceil(L / H) shards; TiledFusedLogitsLoss with 1024-row shards
        ceil_tiles = max(1, math.ceil(length / shape.hidden))
        return replace(base.with_levers(activation_offload=shape.layers, tiled_mlp=ceil_tiles),
                       pinned_rounding="pow2", prefetch_offloaded=False, loss_chunk_size=1024)
    return replace(base, loss_type="nll")  # hf: full logits, no tiling, no offload


def load_measurements(results_dir: str | Path) -> list[Measurement]:
    """Every ok point of benchmarks/results/long_context_*.json, with the settings that ran it."""
    out = []
    for path in sorted(Path(results_dir).glob("long_context_*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from None
        system, model = data.get("system"), data.get("model")
        if system not in SYSTEMS or not isinstance(model, str):
            raise ConfigError(f"{path}: needs \"system\" (one of {SYSTEMS}) and \"model\" (a preset name)")
        steps = int(data.get("settings", {}).get("steps_per_length", 1))
        mode = data.get("settings", {}).get("mode", "train")
        for p in data.get("points", []):
            if p.get("status") != "ok" or p.get("peak_gpu_gb") is None:
                continue
            shape = ModelShape.preset(model)
            # the ALST harness unties a tied lm_head under ZeRO-3 (its fused loss needs that)
            tied = p.get("tied_lm_head", "untied" not in str(p.get("note", "")))
            shape = replace(shape, tied_embeddings=shape.tied_embeddings and bool(tied))
            s = benchmark_settings(system, shape, p, steps, mode)
            out.append(Measurement(source=path.name, system=system, model=model, shape=shape, settings=s,
                                   peak_gpu_gb=float(p["peak_gpu_gb"]), peak_host_gb=p.get("peak_host_rss_gb")))
    return out


@dataclass(frozen=True)
class Comparison:
    measurement: Measurement
    predicted_gpu_gb: float
    predicted_host_gb: float

    @property
    def gpu_error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_gpu_gb - self.measurement.peak_gpu_gb) / self.measurement.peak_gpu_gb

    @property
    def host_error(self) -> float | None:
        m = self.measurement.peak_host_gb
        return None if not m else (self.predicted_host_gb - m) / m


def compare(measurements: list[Measurement]) -> list[Comparison]:
    """Predicted peak allocated GPU memory (what torch.cuda.max_memory_allocated reads, so without
    slack or CUDA context) and host memory per rank, for each measurement."""
    out = []
    for m in measurements:
        e = estimate(m.shape, m.settings)
        out.append(Comparison(m, e.gpu_peak / GIB, e.host_per_rank / GIB))
    return out


def format_comparison(rows: list[Comparison]) -> str:
    head = (f"{'source':<34} {'system':<6} {'model':<10} {'seq_len':>9} {'attention':<10} {'offl':>4} "
            f"{'GPU meas':>9} {'GPU pred':>9} {'err':>7} {'host meas':>9} {'host pred':>9} {'err':>7}")
    lines = [head, "-" * len(head)]
    for c in rows:
        m, s = c.measurement, c.measurement.settings
        he = c.host_error
        lines.append(
            f"{m.source[:34]:<34} {m.system:<6} {m.model:<10} {s.max_length:>9,} {s.attn_implementation[:10]:<10} "
            f"{s.levers.activation_offload:>4} {m.peak_gpu_gb:>9.2f} {c.predicted_gpu_gb:>9.2f} {c.gpu_error:>+7.1%} "
            + (f"{m.peak_host_gb:>9.2f} {c.predicted_host_gb:>9.2f} {he:>+7.1%}" if he is not None
               else f"{'-':>9} {c.predicted_host_gb:>9.2f} {'-':>7}")
            + ("  over-predicted, known (calibration.json)" if m.over_predicted else ""))
    if rows:
        worst = max(rows, key=lambda c: abs(c.gpu_error))
        lines.append(f"worst GPU error {worst.gpu_error:+.1%} ({worst.measurement.system}, "
                     f"{worst.measurement.settings.max_length:,} tokens); GiB = 2**30 bytes")
    return "\n".join(lines)
