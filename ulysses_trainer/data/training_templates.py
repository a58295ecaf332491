"""The training variant of a checkpoint's shipped chat template, where TRL ships one: every family's.

A shipped template rarely marks what the assistant wrote. TRL's SFTTrainer, asked for `assistant_only_loss`,
recognises the templates it knows by their exact text and renders the conversations with its training variant of
the one found, whose `{% generation %}` ... `{% endgeneration %}` blocks mark exactly the trained tokens. The same
variants, byte for byte as TRL 1.16.0 ships them, are in chat_templates/ (see its README): Qwen3.5's, 3.6's and
3.8's (data/qwen3_5_template.py) and, here, Llama 3's, Qwen2.5's, Phi-3's, Phi-3.5's, Gemma 3's and gpt-oss's.
A template that is none of these goes by the rules of data/chat_template.py (its own markers, ChatML turns, or
prefixes), and is refused for assistant_only_loss where none of them finds the assistant's turns.
"""

from __future__ import annotations

from .qwen3_5_template import shipped_variant
from .qwen3_5_template import training_variant as qwen3_5_training_variant

# sha256 of the shipped template (TRL's copy of it, trl/chat_templates/<name>.jinja) -> its training variant's file
TRAINING_VARIANTS = {
    "ba03a121d097859c7b5b9cd03af99aafe95275210d2876f642ad9929a150f122": "llama3_training.jinja",  # Llama 3
    "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f": "qwen2_5_training.jinja",  # Qwen2.5
    "dcaee66df77bfbb789ec541fe713218da30225a526f1db97138fc39ee6dc56aa": "phi3_training.jinja",  # Phi-3
    "78d976a442bcde2f0be15aafbb8e3050e1104f86732266f68403251b89982a90": "phi3_5_training.jinja",  # Phi-3.5
    "7de1c58e208eda46e9c7f86397df37ec49883aeece39fb961e0a6b24088dd3c4": "gemma3_training.jinja",  # Gemma 3
    "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146": "gptoss_training.jinja",  # gpt-oss
}


def training_variant(template: object) -> str | None:
    """TRL's training variant of a shipped template (a dict of named templates: its default), None for a template
    TRL ships none for."""
    return qwen3_5_training_variant(template) or shipped_variant(template, TRAINING_VARIANTS)
