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


def write_checkpoint(path: Path, *, poison: bool = False, seed: int = 0, dtype=None, max_shard_size=None,
                     **config_overrides) -> Path:
    """config.json, model.safetensors and a tokenizer in `path` (a Qwen3 checkpoint directory).

    dtype: the stored dtype (default float32); max_shard_size: save_pretrained's, e.g. "40KB" for several
    files with model.safetensors.index.json, as real checkpoints are stored."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    words = vocab()
    _write_tokenizer(path)
    kwargs = dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                  max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    kwargs.update(config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(Qwen3Config(**kwargs))
    if poison:
        with torch.no_grad():
            model.model.embed_tokens.weight[words[POISON]] = 3e38
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return path


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token="<unk>",
                            pad_token=EOS).save_pretrained(path)


# config.json as the Hub's Qwen3-MoE checkpoints write it (Qwen/Qwen3-30B-A3B's keys), shrunk
MOE_HUB_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "decoder_sparse_step": 1, "eos_token_id": 0, "head_dim": 16, "hidden_act": "silu",
    "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 512,
    "max_window_layers": 2, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 32,
    "norm_topk_prob": True, "num_attention_heads": 8, "num_experts": 4, "num_experts_per_tok": 2,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 32,
}


def write_moe_checkpoint(path: Path, *, seed: int = 0, max_shard_size: str = "40KB", **config_overrides) -> Path:
    """A tiny Qwen3-MoE checkpoint in the Hub's layout: experts stored one by one
    (`model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight`), the router as `mlp.gate.weight`, bf16,
    several safetensors files with model.safetensors.index.json, the Hub's config.json keys."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(path)
    hub = {**MOE_HUB_CONFIG, **config_overrides}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{k: v for k, v in hub.items()
                                                      if k not in ("architectures", "torch_dtype",
                                                                   "transformers_version")}))
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size=max_shard_size)  # transformers 5: per expert
    (path / "config.json").write_text(json.dumps(hub, indent=2) + "\n")
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
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
