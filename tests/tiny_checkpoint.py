"""A tiny local Qwen3 checkpoint with its own word-level tokenizer, and documents for it.

Small enough (vocab 32) that a 2-rank CPU run takes seconds. `poison=True` sets one embedding row
(the word POISON) to 3e38: finite, so the weights load and save as they are, but its square
overflows in RMSNorm, so any step whose data holds that word has a NaN gradient (the loss stays
finite). Every other step trains normally.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar "
         "papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()
POISON = "zeta"
EOS = "<|endoftext|>"


def vocab() -> dict[str, int]:
    return {EOS: 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate([*WORDS, POISON])}}


def write_checkpoint(path: Path, *, poison: bool = False, seed: int = 0, **config_overrides) -> Path:
    """config.json, model.safetensors and a tokenizer in `path` (a Qwen3 checkpoint directory)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    words = vocab()
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token="<unk>",
                            pad_token=EOS).save_pretrained(path)
    kwargs = dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                  max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    kwargs.update(config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(Qwen3Config(**kwargs))
    if poison:
        with torch.no_grad():
            model.model.embed_tokens.weight[words[POISON]] = 3e38
    model.save_pretrained(path, safe_serialization=True)
    return path


def write_documents(path: Path, num_docs: int, words_per_doc: int, *, poison_doc: int | None = None,
                    seed: int = 0) -> Path:
    """jsonl of `num_docs` documents of random WORDS (+ eos each); POISON once in document `poison_doc`."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(num_docs):
            doc = [rng.choice(WORDS) for _ in range(words_per_doc)]
            if i == poison_doc:
                doc[words_per_doc // 2] = POISON
            f.write(json.dumps({"text": " ".join(doc)}) + "\n")
    return path
