"""The weights of final/ in the layout of the checkpoint they were trained from.

Text training builds the family's causal LM. A checkpoint of another class is written back as that class: a
multimodal Qwen3.5 (`Qwen3_5ForConditionalGeneration`: `model.language_model.*`, `model.visual.*`, `lm_head.*`)
gets its trained language model under its own prefix and its vision tower as it was read, so `from_pretrained`
of the same class loads the export. Tensors that transformers leaves unread on load (its
`_keys_to_ignore_on_load_unexpected`: Qwen3.5's multi-token-prediction head `mtp.*`) are copied as they were,
byte for byte, into more shards of the same index. The names and shapes are the checkpoint's: the export is saved
back through the renamings and expert fusions that transformers used loading that checkpoint (found by loading its
safetensors headers on the meta device), so Qwen/Qwen3.5-35B-A3B's fused `experts.gate_up_proj` stay fused,
Qwen3-MoE's experts one by one stay one by one, and a text-only Qwen3.5 saved under `model.language_model.` keeps
that prefix. A preset, a Hub id or .bin weights: the causal LM in transformers' saved format.
"""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from ..errors import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _weight_files(directory: Path) -> dict[str, Path] | None:
    """tensor name -> safetensors file of a checkpoint directory; None without safetensors weights."""
    from safetensors import safe_open

    if (directory / INDEX).is_file():
        weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        return {name: directory / f for name, f in weight_map.items()}
    if (directory / SINGLE).is_file():
        with safe_open(str(directory / SINGLE), framework="pt") as handle:
            return {name: directory / SINGLE for name in handle.keys()}
    return None


def _read(names: list[str], where: dict[str, Path]) -> dict[str, torch.Tensor]:
    """The stored tensors `names`, as stored (dtype and bytes), one file open at a time."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(where[n], []).append(n)
    for f, group in by_file.items():
        with safe_open(str(f), framework="pt") as handle:
            out.update({n: handle.get_tensor(n) for n in group})
    return out


def _model_class(source: PretrainedConfig, original_json: dict[str, Any] | None) -> type:
    """The class the checkpoint was saved from: its config.json's `architectures`, else transformers' image-text
    class for its config."""
    import transformers

    for name in (original_json or {}).get("architectures") or []:
        cls = getattr(transformers, name, None)
        if cls is not None and isinstance(source, cls.config_class):
            return cls
    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(source)]


def _with_text_config(source: PretrainedConfig, trained: PretrainedConfig) -> PretrainedConfig:
    """A copy of the multimodal `source` config whose language-model part is `trained`."""
    out = copy.deepcopy(source)
    text = source.get_text_config(decoder=True)
    key = next(k for k in source.sub_configs if getattr(source, k, None) is text)
    setattr(out, key, copy.deepcopy(trained))
    return out


@dataclass
class UserLayout:
    """How the trained causal LM's state dict becomes the user's checkpoint."""

    config: PretrainedConfig  # the config of the class written (the trained one, or the multimodal one around it)
    model_class: type
    text_prefix: str = "model"  # where the causal LM's `model.` goes in model_class (a wrapper: model.language_model)
    source: dict[str, Path] = field(default_factory=dict)  # the checkpoint's tensors: name -> file
    conversions: list | None = None  # transformers' renamings/fusions that loading the checkpoint used

    def build(self, trained: dict[str, torch.Tensor]) -> torch.nn.Module:
        """model_class on the meta device holding the trained tensors, and the checkpoint's own where the causal LM
        has none (the vision tower); every tensor present. Its save_pretrained writes the checkpoint's layout."""
        config = copy.deepcopy(self.config)
        # the export loads anywhere, without our SP attention (eager for a class without SDPA: gpt-oss)
        attn = "sdpa" if getattr(self.model_class, "_supports_sdpa", True) else "eager"
        config._attn_implementation = attn
        with torch.device("meta"):
            model = self.model_class._from_config(config, attn_implementation=attn)
        if self.conversions is not None:  # saved back through the same conversions, reversed
            model._weight_conversions = self.conversions
        state = {self._held_name(k): v for k, v in trained.items()}
        wanted = set(model.state_dict())
        strange = sorted(set(state) - wanted)
        if strange:
            raise ConfigError(f"the trained tensors {strange[:3]} have no place in {self.model_class.__name__}")
        kept = sorted(k for k in wanted - set(state) if k in self.source)
        model.load_state_dict({**state, **_read(kept, self.source)}, strict=False, assign=True)
        model.tie_weights()
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise ConfigError(f"the export of {self.model_class.__name__} lacks weights for {missing[:3]}")
        if model.generation_config is not None:
            model.generation_config.use_cache = True
        return model

    def _held_name(self, key: str) -> str:
        return self.text_prefix + key[len("model"):] if key.startswith("model.") else key

    def _ignored(self, name: str) -> bool:
        patterns = getattr(self.model_class, "_keys_to_ignore_on_load_unexpected", None) or []
        return any(re.search(p, name) for p in patterns)

    def carried(self) -> list[str]:
        """The checkpoint's tensors that transformers leaves unread loading model_class (`mtp.*`): copied as
        they are."""
        return sorted(n for n in self.source if self._ignored(n))


def _used_conversions(layout: UserLayout) -> list:
    """The renamings and fusions transformers applies loading the checkpoint's tensors (those it reads) into
    layout.model_class: from_pretrained on the meta device, from the safetensors headers alone."""
    from transformers.utils import logging as hf_logging

    from .checkpoint_keys import header_tensors

    tensors = header_tensors(sorted(set(layout.source.values())))
    tensors = {n: t for n, t in tensors.items() if not layout._ignored(n)}
    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # its loading report is the checkpoint check's to give (checkpoint_keys.py)
    hf_logging.disable_progress_bar()
    try:
        probe = layout.model_class.from_pretrained(None, config=copy.deepcopy(layout.config), state_dict=tensors,
                                                   device_map="meta", use_kernels=False)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()
    return list(getattr(probe, "_weight_conversions", None) or [])


def user_layout(trained: PretrainedConfig, source_dir: str | None,
                original_json: dict[str, Any] | None) -> UserLayout:
    """The layout of final/ for a model trained with config `trained` from `source_dir` (None: a preset or a Hub
    id: the causal LM in transformers' saved format)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING, AutoConfig

    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING[type(trained)]
    tensors = _weight_files(Path(source_dir)) if source_dir and os.path.isdir(source_dir) else None
    if tensors is None:
        return UserLayout(trained, causal_lm)
    source = AutoConfig.from_pretrained(source_dir, local_files_only=True)
    wrapped = source.get_text_config(decoder=True) is not source
    config = _with_text_config(source, trained) if wrapped else trained
    cls = _model_class(source, original_json) if wrapped else causal_lm
    prefix = "model"
    if wrapped:
        with torch.device("meta"):
            shell = cls._from_config(copy.deepcopy(config))
        text_cls = MODEL_MAPPING[type(trained)]
        prefix = next((n for n, m in shell.named_modules() if type(m) is text_cls), None)
        if prefix is None:
            raise ConfigError(f"{cls.__name__} of {source_dir} holds no {text_cls.__name__}: the trained language "
                              f"model has no place in it")
    layout = UserLayout(config, cls, prefix, tensors)
    layout.conversions = _used_conversions(layout)
    return layout


def add_carried(directory: str, names: list[str], source: dict[str, Path], max_shard_size: int | str) -> None:
    """Write the checkpoint's tensors `names` (read as stored) into `directory` beside what save_pretrained wrote
    there, in shards of at most `max_shard_size` bytes (an int; a string as transformers reads it), every shard
    renamed model-0000i-of-0000n.safetensors and listed in one model.safetensors.index.json."""
    if not names:
        return
    from safetensors.torch import save_file

    from ..config.checks import shard_bytes

    d = Path(directory)
    limit = max_shard_size if isinstance(max_shard_size, int) else shard_bytes(max_shard_size)
    written = _weight_files(d) or {}
    clash = sorted(set(names) & set(written))
    if clash:
        raise ConfigError(f"the checkpoint's tensors {clash[:3]} are also written by the export")
    stored = {f: _sizes(f) for f in {source[n] for n in names}}
    groups: list[list[str]] = [[]]
    size = 0
    for n in names:  # names in order; a new shard when the next tensor would pass the limit
        nbytes = stored[source[n]][n]
        if groups[-1] and limit and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += nbytes
    files = sorted({f.name for f in written.values()})
    extra = [f"carried-{i}.safetensors.tmp" for i in range(len(groups))]
    for group, name in zip(groups, extra):
        save_file(_read(group, source), str(d / name), metadata={"format": "pt"})
    order = files + extra
    final = {old: f"model-{i + 1:05d}-of-{len(order):05d}.safetensors" for i, old in enumerate(order)}
    weight_map: dict[str, str] = {}
    total = 0
    for old in order:
        for n, nbytes in _sizes(d / old).items():
            weight_map[n] = final[old]
            total += nbytes
    for old in order:
        os.replace(d / old, d / (final[old] + ".renamed"))
    for old in order:
        os.replace(d / (final[old] + ".renamed"), d / final[old])
    (d / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(
        weight_map.items()))}, indent=2) + "\n")


def keep_source_files(directory: str, source_dir: str | None) -> bool:
    """Regroup the export's tensors in `directory` into the files of the sharded checkpoint in `source_dir`: each
    tensor in the file the checkpoint's model.safetensors.index.json names, under that name, with that index
    (its total_size recounted). False, and nothing changed, where the checkpoint is not sharded or the export's
    tensor names are not the checkpoint's. One file is held in memory at a time."""
    from safetensors.torch import save_file

    index = Path(source_dir) / INDEX if source_dir else None
    if index is None or not index.is_file():
        return False
    source_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    d = Path(directory)
    written = _weight_files(d)
    if written is None or set(written) != set(source_map):
        return False
    if all(written[n].name == f for n, f in source_map.items()) and (d / INDEX).is_file():
        return True  # save_pretrained already cut them so
    files = sorted(set(source_map.values()))
    for f in files:
        names = [n for n, where in source_map.items() if where == f]
        save_file(_read(names, written), str(d / (f + ".regrouped")), metadata={"format": "pt"})
    for old in set(written.values()):
        old.unlink()
    for f in files:
        os.replace(d / (f + ".regrouped"), d / f)
    total = sum(sum(_sizes(d / f).values()) for f in files)
    (d / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(
        source_map.items()))}, indent=2) + "\n")
    return True


def _header(file: Path) -> dict[str, dict[str, Any]]:
    """name -> {dtype, shape, data_offsets} of every tensor of a safetensors file."""
    with open(file, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    header.pop("__metadata__", None)
    return header


def _sizes(file: Path) -> dict[str, int]:
    """name -> stored bytes of every tensor of a safetensors file, from its header alone."""
    return {n: v["data_offsets"][1] - v["data_offsets"][0] for n, v in _header(file).items()}


_FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


def source_shard_bytes(layout: UserLayout, dtype: torch.dtype) -> int | None:
    """The checkpoint's largest safetensors file, in bytes as the export stores its tensors (floating ones in
    `dtype`, carried ones as they are): the max_shard_size under which save_pretrained cuts the same tensors, in
    the same order, where the checkpoint was cut (a file ends where the next tensor would pass the limit, and the
    limit is at least every file). None without the checkpoint's safetensors (a preset, a Hub id)."""
    if not layout.source:
        return None
    carried = set(layout.carried())
    largest = 0
    for file in sorted(set(layout.source.values())):
        total = 0
        for name, v in _header(file).items():
            stored = v["data_offsets"][1] - v["data_offsets"][0]
            width = _FLOAT_BYTES.get(v["dtype"])
            total += stored if width is None or name in carried else stored // width * dtype.itemsize
        largest = max(largest, total)
    return largest or None
