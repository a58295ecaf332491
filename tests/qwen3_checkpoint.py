"""A local checkpoint directory in Qwen3's layout for chat tests: the Qwen vocabulary as an HF fast tokenizer
with Qwen3's added tokens (<think>, <tool_call>, ... not special), eos <|im_end|>, pad <|endoftext|>, a chat
template, and (optionally) the `tiny` preset's weights.

Qwen3's shipped template is read from a fixtures folder that is not shipped (ULYSSES_FIXTURES, else a
`shared/fixtures` folder beside the repository); tests that need it skip when it is absent.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QWEN3_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def fixtures_dir() -> Path | None:
    for d in (os.environ.get("ULYSSES_FIXTURES"), ROOT.parent / "shared" / "fixtures"):
        if d and Path(d).is_dir():
            return Path(d)
    return None


def qwen3_template_or_skip() -> str:
    d = fixtures_dir()
    path = d / "qwen3" / "chat_template.jinja" if d else None
    if path is None or not path.is_file():
        pytest.skip("Qwen3's chat template fixture (shared/fixtures/qwen3/chat_template.jinja) is absent")
    return path.read_text(encoding="utf-8")


def write_qwen3_tokenizer(path: Path, chat_template: str | None) -> Path:
    from transformers import AutoTokenizer

    from ulysses_trainer.data.qwen_bpe import QwenBPETokenizer

    path.mkdir(parents=True, exist_ok=True)
    QwenBPETokenizer().save_pretrained(str(path))
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    tok.add_tokens(QWEN3_ADDED)  # Qwen3's: added, not special
    tok.eos_token = "<|im_end|>"
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(str(path))
    return path


# Qwen/Qwen3-8B's generation_config.json (the sampling settings its model card recommends)
QWEN3_GENERATION = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
                    "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}


def write_qwen3_checkpoint(path: Path, chat_template: str | None, seed: int = 0,
                           generation: dict | None = None) -> Path:
    """The tiny preset's weights with Qwen3's generation_config (`generation`, default QWEN3_GENERATION: eos
    [<|im_end|>, <|endoftext|>], sampling at temperature 0.6, top_p 0.95, top_k 20)."""
    import torch

    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.model.load import build_model, model_config_for

    write_qwen3_tokenizer(path, chat_template)
    model = build_model(model_config_for(TrainConfig(max_length=512)), torch.float32, None, seed=seed)
    model.save_pretrained(str(path), safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps(generation or QWEN3_GENERATION, indent=1))
    return path
