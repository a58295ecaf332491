"""What `final/` holds beside the weights: the checkpoint's own files, and what makes a chat-trained export a chat
model.

The tokenizer as loaded (a checkpoint's own chat template with it); the checkpoint's generation_config.json and
its processor and tokenizer side files as they were (image/video preprocessors, the processor's chat_template.json,
vocab.json and merges.txt), so AutoProcessor reads in final/ what it read in the checkpoint; where the run replaced
the template (chat_template_path), the processor's chat_template.json carries the template trained with; where the
tokenizer has no template (the built-in Qwen3 format),
this project's Jinja rendering of that format; for a ChatML format the turn end `<|im_end|>` first among the
generation_config's eos ids, as Qwen3 checkpoints ship them; for another template the token it ends an answer with
(Llama 3's <|eot_id|>) first among them where they lack it (a base checkpoint's eos alone); for a LoRA adapter a
`base_model_name_or_path` that loads.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from ..data.qwen3_template import QWEN3_CHAT_TEMPLATE, TURN_END
from ..data.tokenizer import PROCESSOR_TEMPLATE, processor_chat_template

_GENERATION_CONFIG = "generation_config.json"
# the checkpoint's files beside its weights that final/ keeps where the export wrote none: a multimodal
# checkpoint's processor files (Qwen3.5: image and video preprocessors, the processor's chat template, which
# AutoProcessor reads before chat_template.jinja) and the tokenizer files its save_pretrained does not write
_SIDE_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
               PROCESSOR_TEMPLATE, "vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "added_tokens.json", "tokenizer.model")


def source_file(source: str | None, name: str) -> Path | None:
    """The file `name` of the checkpoint trained from (a local directory, or a Hub id's cached copy); None for
    a preset or where it has none."""
    if source is None:
        return None
    path = Path(source) / name
    if path.is_file():
        return path
    if Path(source).is_dir():
        return None
    from transformers.utils import cached_file

    try:
        found = cached_file(source, name, local_files_only=True, _raise_exceptions_for_missing_entries=False)
    except Exception:  # not cached, or no such entry
        return None
    return Path(found) if found else None


class ExportFiles:
    """Passed where the export takes a tokenizer: `save_pretrained(dir)` runs after the weights are written.
    source: the checkpoint trained from (a directory or Hub id; None for a preset), whose generation_config and
    processor files final/ keeps; an adapter's directory takes none of them."""

    def __init__(self, tokenizer: Any, chat: bool, adapter_base: str | None = None,
                 source: str | None = None) -> None:
        self.tokenizer, self.chat, self.adapter_base, self.source = tokenizer, chat, adapter_base, source

    def save_pretrained(self, directory: str) -> None:
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(directory)
        self._copy_source_files(directory)
        template = saved_chat_template(directory)
        if self.chat and template is None:  # the built-in format: its template, so apply_chat_template works
            with open(os.path.join(directory, "chat_template.jinja"), "w", encoding="utf-8") as f:
                f.write(QWEN3_CHAT_TEMPLATE)
            template = QWEN3_CHAT_TEMPLATE
        if self.chat and template is not None and TURN_END in template:
            turn_end = self.tokenizer.special_token_id(TURN_END) if self.tokenizer is not None else None
            if turn_end is not None:
                _add_eos(directory, int(turn_end))
        elif self.chat and template is not None and self.tokenizer is not None:
            answer_end = template_answer_end(self.tokenizer)
            if answer_end is not None:  # a base checkpoint's eos is not the chat's: generation stops at both
                _add_eos(directory, answer_end, only_if_absent=True)
        if self.adapter_base is not None:
            _set_adapter_base(directory, self.adapter_base)

    def _copy_source_files(self, directory: str) -> None:
        """The checkpoint's generation_config.json over the one save_pretrained rendered from the config (which
        keeps only the token ids: do_sample, temperature, top_p, top_k would be lost), where the export has one
        (an adapter's directory has none and keeps none); its processor and tokenizer side files where the export
        wrote none."""
        generation = source_file(self.source, _GENERATION_CONFIG)
        if generation is not None and os.path.isfile(os.path.join(directory, _GENERATION_CONFIG)):
            shutil.copyfile(generation, os.path.join(directory, _GENERATION_CONFIG))
        if self.adapter_base is not None:
            return
        for name in _SIDE_FILES:
            found = source_file(self.source, name)
            if found is None or os.path.exists(os.path.join(directory, name)):
                continue
            if name == PROCESSOR_TEMPLATE:
                _write_processor_template(found, directory)
            else:
                shutil.copyfile(found, os.path.join(directory, name))


def _write_processor_template(found: Path, directory: str) -> None:
    """The checkpoint's chat_template.json as it was, unless the run replaced the tokenizer's template
    (chat_template_path): then with the template final/'s tokenizer carries, so the processor renders what was
    trained (AutoProcessor prefers this file to chat_template.jinja)."""
    target = os.path.join(directory, PROCESSOR_TEMPLATE)
    ours = saved_chat_template(directory)
    loaded = saved_chat_template(str(found.parent)) or processor_chat_template(found.parent)  # load_tokenizer's
    if ours is None or ours == loaded:
        shutil.copyfile(found, target)
        return
    with open(found, encoding="utf-8") as f:
        processor = json.load(f)
    processor["chat_template"] = ours
    with open(target, "w", encoding="utf-8") as f:
        json.dump(processor, f, indent=2, ensure_ascii=False)
        f.write("\n")


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


_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def template_answer_end(tokenizer: Any) -> int | None:
    """The special token a checkpoint's chat template trains an answer to end with: the last trained special token of
    one exchange rendered as assistant_only_loss renders it (Llama 3's <|eot_id|>, Gemma's <end_of_turn>, gpt-oss's
    <|return|>); None where the template has none or cannot render the exchange."""
    from ..data.documents import chat_template_of
    from ..errors import ConfigError

    renderer = chat_template_of(tokenizer)
    if renderer is None:
        return None
    try:
        segments = renderer.conversation(_PROBE, None, True, "the export's answer-end probe")
    except ConfigError:  # a template that refuses this exchange: the generation_config stays the checkpoint's
        return None
    ends = [s.text for s in segments if s.trained and s.special]
    return int(tokenizer.special_token_id(ends[-1])) if ends else None


def _add_eos(directory: str, turn_end: int, only_if_absent: bool = False) -> None:
    """The turn end first among the eos ids of the export's generation_config (the checkpoint's own, with its eos
    list, e.g. Qwen3's [<|im_end|>, <|endoftext|>]; an adapter's directory has none and keeps none); only_if_absent:
    a list that holds it already stays as the checkpoint wrote it."""
    path = os.path.join(directory, _GENERATION_CONFIG)
    if not os.path.isfile(path):
        return
    with open(path) as f:
        gen = json.load(f)
    eos = gen.get("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if only_if_absent and turn_end in eos:
        return
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
