"""What `final/` holds beside the weights so that a chat-trained export is a chat model.

The tokenizer as loaded (a checkpoint's own chat template with it); where the tokenizer has no template
(the built-in Qwen3 format), this project's Jinja rendering of that format; for a ChatML format the turn end
`<|im_end|>` first among the generation_config's eos ids, as Qwen3 checkpoints ship them; for a LoRA adapter
a `base_model_name_or_path` that loads.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..data.qwen3_template import QWEN3_CHAT_TEMPLATE, TURN_END

_GENERATION_CONFIG = "generation_config.json"


class ExportFiles:
    """Passed where the export takes a tokenizer: `save_pretrained(dir)` runs after the weights are written."""

    def __init__(self, tokenizer: Any, chat: bool, adapter_base: str | None = None,
                 source_dir: str | None = None) -> None:
        self.tokenizer, self.chat, self.adapter_base, self.source_dir = tokenizer, chat, adapter_base, source_dir

    def save_pretrained(self, directory: str) -> None:
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(directory)
        template = saved_chat_template(directory)
        if self.chat and template is None:  # the built-in format: its template, so apply_chat_template works
            with open(os.path.join(directory, "chat_template.jinja"), "w", encoding="utf-8") as f:
                f.write(QWEN3_CHAT_TEMPLATE)
            template = QWEN3_CHAT_TEMPLATE
        if self.chat and template is not None and TURN_END in template:
            turn_end = self.tokenizer.special_token_id(TURN_END) if self.tokenizer is not None else None
            if turn_end is not None:
                _add_eos(directory, int(turn_end), self.source_dir)
        if self.adapter_base is not None:
            _set_adapter_base(directory, self.adapter_base)


def saved_chat_template(directory: str) -> str | None:
    path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    cfg = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(cfg):
        with open(cfg, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def _add_eos(directory: str, turn_end: int, source_dir: str | None) -> None:
    """The turn end first among the eos ids of the export's generation_config (written by the model's
    save_pretrained; an adapter's directory has none and keeps none)."""
    path = os.path.join(directory, _GENERATION_CONFIG)
    if not os.path.isfile(path):
        return
    with open(path) as f:
        gen = json.load(f)
    source = os.path.join(source_dir, _GENERATION_CONFIG) if source_dir else None
    if source and os.path.isfile(source):  # the checkpoint's own eos list (Qwen3: [<|im_end|>, <|endoftext|>])
        with open(source) as f:
            gen["eos_token_id"] = json.load(f).get("eos_token_id", gen.get("eos_token_id"))
    eos = gen.get("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    gen["eos_token_id"] = [turn_end] + [e for e in eos if e != turn_end]
    with open(path, "w") as f:
        json.dump(gen, f, indent=2)


def _set_adapter_base(directory: str, base: str) -> None:
    path = os.path.join(directory, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["base_model_name_or_path"] = base
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def adapter_base(model_name_or_path: str, source: str | None, output_dir: str, name: str = "final") -> str:
    """Where an adapter's base loads from: the checkpoint (a local directory as an absolute path, a Hub id as
    given), or for a preset the base that the export writes to <name>/base (final/, or a save_only_model
    checkpoint)."""
    if source is None:
        return os.path.abspath(os.path.join(output_dir, name, "base"))
    return os.path.abspath(source) if os.path.isdir(source) else source
