"""Does a checkpoint's set of tensors fit the model its config describes? Checked before any heavy work.

The tensors' names, shapes and dtypes come from the safetensors headers alone (no weight is read). They are
handed to transformers' own `from_pretrained` as meta tensors on a meta model, so its renaming and expert fusion
(Qwen3-MoE's per-expert Hub layout fused into `gate_up_proj` / `down_proj`) run exactly as at the real load, and
its loading report says what would stay unloaded (missing: initialised from random), go unused (unexpected) or
mismatch in shape. Any of the three is refused: a run of GPU-days must not start from a partly random model.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from transformers import PretrainedConfig

from ..errors import ConfigError

_SHOWN = 3  # keys named per kind; the count says how many more
# safetensors header dtype -> torch dtype (only the shape matters here; unknown ones read as float32)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def header_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """name -> an empty meta tensor of the stored shape and dtype, for every tensor in the safetensors `files`."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                part = handle.get_slice(name)
                out[name] = torch.empty(part.get_shape(), dtype=_DTYPES.get(part.get_dtype(), torch.float32),
                                        device="meta")
    return out


class _Captured(logging.Handler):
    """The log records of one call (transformers' loading report), kept for reading."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage()))

    def text(self) -> str:
        return "\n".join(self.lines)


def _listed(kind: str, keys: list[str]) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return f"{len(keys)} {kind} ({', '.join(keys[:_SHOWN])}{more})"


def _shape(s) -> str:
    return "[" + ", ".join(str(int(d)) for d in s) + "]"


def loading_problems(config: PretrainedConfig, tensors: dict[str, torch.Tensor]) -> list[str]:
    """What transformers would leave missing, unused or mismatched loading `tensors` into `config`'s model."""
    import transformers
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.utils import logging as hf_logging

    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    root = logging.getLogger("transformers")
    report = _Captured()
    handlers, level, bar = root.handlers[:], root.level, hf_logging.is_progress_bar_enabled()
    root.handlers, root.level = [report], logging.WARNING  # its report table is read here, not printed
    hf_logging.disable_progress_bar()
    try:  # use_kernels=False: transformers >= 5.25 would kernelize by default, which refuses a meta model
        _, info = cls.from_pretrained(None, config=config, state_dict=tensors, device_map="meta",
                                      output_loading_info=True, ignore_mismatched_sizes=True, use_kernels=False)
    except RuntimeError as exc:  # expert fusion of tensors that do not fit fails inside the conversion, after
        rows = dict(re.findall(r"^([\w.]+)\s*\|\s*(MISSING|UNEXPECTED)\s*\|", report.text(), re.M))  # its report
        failed = sorted({k.rstrip('.') for k in re.findall(r"destined for \[?'?([\w.]+)", report.text())})
        why = sorted(set(re.findall(r"^(?:RuntimeError|ValueError): (.+)$", report.text(), re.M)))
        if not failed:
            return [f"transformers {transformers.__version__} cannot load them: {str(exc).strip().splitlines()[0]}"]
        info = {"missing_keys": [k for k, v in rows.items() if v == "MISSING"],
                "unexpected_keys": [k for k, v in rows.items() if v == "UNEXPECTED"]}
        fused = _listed("fused tensors cannot be built from the checkpoint's parts", failed)
        return info_problems(info, config.num_hidden_layers) + [fused + (f" ({why[0].strip()})" if why else "")]
    finally:
        root.handlers, root.level = handlers, level
        if bar:
            hf_logging.enable_progress_bar()
    return info_problems(info, config.num_hidden_layers)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _dropped_layer(key: str, layers: int | None) -> bool:
    """A tensor of a decoder layer past the model's last: `num_hidden_layers` set below the checkpoint's
    (model_init_kwargs) keeps the first layers and drops the rest on purpose; nothing trains from random."""
    m = _LAYER.search(key)
    return layers is not None and m is not None and int(m.group(1)) >= layers


def info_problems(info: dict, layers: int | None = None) -> list[str]:
    """The loading info of `from_pretrained(..., output_loading_info=True)` as problems, one per kind; unused
    tensors of layers at index >= `layers` (the model's num_hidden_layers) are not a problem."""
    problems = []
    if info.get("missing_keys"):
        problems.append(_listed("tensors the model needs are missing", list(info["missing_keys"])))
    unused = [k for k in info.get("unexpected_keys") or [] if not _dropped_layer(k, layers)]
    if unused:
        problems.append(_listed("checkpoint tensors are not used by the model", unused))
    mismatched = sorted(info.get("mismatched_keys") or [])
    if mismatched:
        shown = [f"{k} {_shape(ckpt)} where the model has {_shape(model)}" for k, ckpt, model in mismatched]
        problems.append(_listed("tensors have the wrong shape", shown))
    problems += [str(m).strip().splitlines()[0] for m in info.get("error_msgs") or [] if str(m).strip()]
    return problems


def refusal(where: str, model_type: str, problems: list[str]) -> ConfigError:
    return ConfigError(f"the checkpoint {where} does not fit the {model_type} model its config describes: "
                       f"{'; '.join(problems)} (names as transformers loads them); training would start those "
                       f"weights from random. Fix the checkpoint (the complete files, tensor names and shapes as "
                       f"save_pretrained writes them) or its config.json and model_init_kwargs so both describe "
                       f"the same model")


def check_checkpoint_tensors(directory: Path, files: list[Path], config: PretrainedConfig) -> None:
    """ConfigError unless every tensor of the safetensors `files` loads into `config`'s model and every
    parameter of that model is loaded (names after transformers' renaming and expert fusion)."""
    tensors = header_tensors(files)
    index = directory / "model.safetensors.index.json"
    problems = []
    if index.is_file():
        listed = set(json.loads(index.read_text()).get("weight_map", {}))
        lacking = sorted(listed - set(tensors))
        if lacking:
            problems.append(_listed(f"tensors named by {index.name} are in none of its files", lacking))
    problems += loading_problems(config, tensors)
    if problems:
        raise refusal(str(directory), config.model_type, problems)
