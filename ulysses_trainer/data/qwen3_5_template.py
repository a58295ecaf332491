"""Qwen3.5's chat templates (and those of its successors on the same architecture, Qwen3.6 and Qwen3.8):
recognising the ones the checkpoints ship, and the training variant of each that assistant_only_loss renders with.

Qwen3.5's template is not Qwen3's: tool calls are XML (`<tool_call>\\n<function=NAME>\\n<parameter=...>`), content
may be a list of parts, and the think block of every assistant turn before the last user query is dropped (the
last turns keep theirs), so it is not prefix-preserving. As TRL's SFTTrainer does with `assistant_only_loss`, a
checkpoint whose tokenizer carries one of these shipped templates (recognised by its SHA-256) is rendered with
TRL's training variant of it (chat_templates/, see its README): every assistant turn with its think block, the
assistant's output inside `{% generation %}` blocks, which mark exactly the trained tokens. Without
assistant_only_loss the shipped template renders the conversation as it is (the text the model is prompted with);
the export ships the shipped template, as loaded.
"""

from __future__ import annotations

import hashlib
from importlib import resources

# sha256 of the shipped template -> its training variant's file in chat_templates/
TRAINING_VARIANTS = {
    "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715": "qwen3_5_think_training.jinja",
    "273d8e0e683b885071fb17e08d71e5f2a5ddfb5309756181681de4f5a1822d80": "qwen3_5_nothink_training.jinja",
    "e84f32a23fdda27689f868aa4a1a5621f41133e51a48d7f3efcbea2839574259": "qwen3_6_training.jinja",
    "c3cf9e34abf4f9e36c2d72165aa9c132d3e2a725b6c2586aaa3a8af9d7a81041": "qwen3_8_training.jinja",
}


def training_variant(template: object) -> str | None:
    """The training variant of a shipped Qwen3.5-family template (a dict of named templates: its default), None for
    any other template."""
    return shipped_variant(template, TRAINING_VARIANTS)


def shipped_variant(template: object, variants: dict[str, str]) -> str | None:
    """The packaged template `variants` maps a shipped template's sha256 to (a dict of named templates: its
    default), None for a template it does not name."""
    if isinstance(template, dict):
        template = template.get("default")
    if not isinstance(template, str):
        return None
    name = variants.get(hashlib.sha256(template.encode("utf-8")).hexdigest())
    if name is None:
        return None
    return resources.files(__package__).joinpath("chat_templates", name).read_text(encoding="utf-8")
