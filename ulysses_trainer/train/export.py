"""The final export: the ZeRO-3 shards consolidated into a Hugging Face directory (`final/`), or a LoRA
adapter as PEFT writes one. Rank 0 writes into `<target>.tmp`, synced, then renamed over the target: a reader
sees the old directory or the whole new one. A failed write ends every rank alike; the checkpoints stay."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from collections.abc import Callable

import torch

from ..config.checks import shard_bytes
from ..data.formats import CONVERSATIONAL, PROMPT_COMPLETION
from ..model.export_config import dtype_change_note, export_config_json
from ..model.export_layout import add_carried, keep_source_files, source_shard_bytes, user_layout
from ..model.lora import lora_scaling, merged_state_dict
from .chat_export import ExportFiles, adapter_base, source_file
from .checkpoint import agree_on_failure, fsync_tree
from .output_guard import OutputWriteError, describe_failure, failure_message
from .prepare import PreparedRun

log = logging.getLogger(__name__)
DEFAULT_SHARD = "5GB"  # save_pretrained's, where there is no checkpoint whose sharding to keep


def export_model(engine, prepared: PreparedRun, peft_model, is_main: bool, name: str) -> None:
    """The model as HF files in output_dir/<name> (final/, or a save_only_model checkpoint): the adapter
    (LoRA without merge_lora) or the whole, merged model. Collective."""
    cfg, source = prepared.cfg, prepared.source
    chat = getattr(prepared.train_data, "kind", None) in (CONVERSATIONAL, PROMPT_COMPLETION)
    config_file = source_file(source, "config.json")  # a Hub id: its cached snapshot, which the run loaded
    source_dir = str(config_file.parent) if config_file is not None else None
    files = ExportFiles(prepared.tokenizer, chat, source=source)
    shard = shard_bytes(cfg.max_shard_size) if cfg.max_shard_size is not None else None  # None: the checkpoint's
    if peft_model is not None and not cfg.merge_lora:
        base = adapter_base(cfg.model_name_or_path, source, cfg.output_dir, name)
        export_adapter(engine, peft_model, cfg.output_dir, ExportFiles(prepared.tokenizer, chat, adapter_base=base),
                       is_main, name=name)
        if source is None:  # a preset's base exists nowhere else: <name>/base, which the adapter names
            export_hf(engine, prepared.model_config, cfg.output_dir, files, is_main,
                      transform=lambda sd: merged_state_dict(sd, 0.0), name=os.path.join(name, "base"),
                      max_shard_size=shard or DEFAULT_SHARD)
    else:
        merge = (lambda sd: merged_state_dict(sd, lora_scaling(peft_model))) if peft_model else None
        export_hf(engine, prepared.model_config, cfg.output_dir, files, is_main, transform=merge,
                  config_json=export_config_json(cfg, prepared.model_config, prepared.bf16), max_shard_size=shard,
                  name=name, source_dir=source_dir)
        note = dtype_change_note(source, prepared.bf16) if is_main else None
        if note:  # said, not silently kept: the weights are what was trained
            log.info(note if name == "final" else note.replace("final/", f"{name}/", 1))


def export_adapter(engine, peft_model, output_dir: str, tokenizer, is_main: bool, name: str = "final") -> str | None:
    """LoRA: gather the adapter weights (collective: every rank enters) and write `final/` on rank 0 as PEFT
    writes an adapter (adapter_config.json + adapter_model.safetensors), which PeftModel.from_pretrained loads."""
    import deepspeed

    target = os.path.join(output_dir, name)
    adapters = [p for p in engine.module.parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters(adapters, modifier_rank=None):
        _export_on_main(is_main, target, lambda: _replace_dir(
            target + ".tmp", target, lambda d: peft_model.save_pretrained(d, safe_serialization=True), tokenizer))
    return target if is_main else None


def export_hf(engine, config, output_dir: str, tokenizer, is_main: bool, prefix: str = "causal_lm.",
              transform=None, config_json: dict | None = None, max_shard_size: int | str | None = None,
              name: str = "final", source_dir: str | None = None) -> str | None:
    """Consolidate the ZeRO-3 shards (collective) and write `final/` as HF safetensors on rank 0, sharded as
    save_pretrained shards (model.safetensors.index.json beside several files; a Qwen3-MoE in the Hub's
    per-expert layout); a failed write raises OutputWriteError on every rank (the checkpoints stay).
    transform: applied to the consolidated state dict first (LoRA: merge the adapters into the weights);
    config_json: written as final/config.json (model/export_config.py), else transformers' rendering of config;
    source_dir: the checkpoint directory trained from, whose layout final/ takes (model/export_layout.py);
    max_shard_size None: the checkpoint's own sharding (its largest file), else 5GB."""

    state = engine._zero3_consolidated_16bit_state_dict()
    target = os.path.join(output_dir, name)  # name: final, or final/base (a preset adapter's base)
    _export_on_main(is_main, target, lambda: _write_export(state, config, target + ".tmp", target, tokenizer,
                                                           prefix, transform, config_json, max_shard_size,
                                                           source_dir))
    return target if is_main else None


def _export_on_main(is_main: bool, target: str, write: Callable[[], None]) -> None:
    """Collective: rank 0 runs `write` (into target.tmp, renamed to target); a failed write (a full disk:
    OSError, torch's RuntimeError, safetensors' SafetensorError) removes target.tmp and raises
    OutputWriteError on every rank. The checkpoints are untouched, so a resume only exports."""
    from safetensors import SafetensorError

    failure: tuple[int, str] | None = None
    if is_main:
        tmp = target + ".tmp"
        try:
            write()
        except (OSError, RuntimeError, SafetensorError) as exc:
            failure = (describe_failure(exc, tmp), str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
            shutil.rmtree(tmp, ignore_errors=True)
    code = agree_on_failure(failure[0] if failure else 0)  # in place of a barrier: all ranks learn the outcome
    if code:
        raise OutputWriteError(failure_message("the final export", target, code, failure[1] if failure else ""))


def _write_export(state: dict, config, tmp: str, target: str, tokenizer, prefix: str, transform=None,
                  config_json: dict | None = None, max_shard_size: int | str | None = None,
                  source_dir: str | None = None) -> None:
    """The state dict of the trained causal LM as the checkpoint it came from (model/export_layout.py: its
    class, the tensors it keeps untouched) or, for a preset, as the causal LM."""
    state = {k.removeprefix(prefix): v for k, v in state.items()}
    if transform is not None:
        state = transform(state)
    config = copy.deepcopy(config)
    config.use_cache = True  # training turned the KV cache off; generation from the export wants it
    layout = user_layout(config, source_dir, config_json)
    model = layout.build(state)
    as_source = max_shard_size is None  # the checkpoint's files: its largest file's size, then its index
    if as_source:
        dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
        max_shard_size = source_shard_bytes(layout, dtype) or DEFAULT_SHARD

    def write(d: str) -> None:
        model.save_pretrained(d, max_shard_size=max_shard_size)
        add_carried(d, layout.carried(), layout.source, max_shard_size)
        if as_source:  # save_pretrained's order of tensors is not the checkpoint's: its index decides
            keep_source_files(d, source_dir)
        if config_json is not None:  # the user's config, not transformers' rendering of the training one
            with open(os.path.join(d, "config.json"), "w") as f:
                f.write(json.dumps(config_json, indent=2, sort_keys=True) + "\n")

    _replace_dir(tmp, target, write, tokenizer)


def _replace_dir(tmp: str, target: str, write: Callable[[str], None], tokenizer) -> None:
    """`write` (and the tokenizer) into a fresh `tmp`, synced to disk, then renamed over `target`: a reader
    sees the old directory or the whole new one, never half of it."""
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(tmp)
    fsync_tree(tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.rename(tmp, target)
