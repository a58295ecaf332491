"""Tiny local checkpoints of the families beyond Qwen, as their users hold them: transformers' own classes saved with
save_pretrained (bf16, several shards and an index), a generation_config.json of their own, and a word-level
tokenizer built offline whose special tokens are the family's chat tokens (`<|start_header_id|>`, `<start_of_turn>`,
`[INST]`, ...), carrying the chat template given.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.tiny_checkpoint import WORDS

EOS = "<|endoftext|>"
# the words every tokenizer here knows besides the vocabulary's: the role names templates write
ROLES = ("system", "user", "assistant", "model", "tool")

# per model_type: (the transformers config and causal LM class names, config fields beyond COMMON)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        max_position_embeddings=256, rope_parameters={
            "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16, head_dim=16)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16, final_logit_softcapping=30.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                            head_dim=16, router_aux_loss_coef=0.02)),
    "ministral": ("MinistralConfig", "MinistralForCausalLM", dict(
        head_dim=16, sliding_window=16, layer_types=["sliding_attention", "full_attention"])),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict()),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        embedding_multiplier=12.0, attention_multiplier=0.2, residual_multiplier=0.3, logits_scaling=4.0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict()),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"])),
}
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
GENERATION = {"bos_token_id": 0, "eos_token_id": [0, 1], "do_sample": True, "temperature": 0.6, "top_p": 0.9}


def write_tokenizer(path: Path, specials: tuple[str, ...] = (), template: str | None = None, *,
                    bos: str | None = None) -> int:
    """A word-level tokenizer in `path` (WORDS, ROLES, `specials` as special tokens, eos <|endoftext|>, bos `bos`
    where given, one of `specials`) with `template` as its chat template; its vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {EOS: 0, "<unk>": 1}
    for w in (*WORDS, *ROLES):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token="<unk>", pad_token=EOS)
    fast.add_special_tokens({"additional_special_tokens": [AddedToken(s, special=True, normalized=False)
                                                           for s in specials]})
    if bos is not None:
        fast.bos_token = bos
    if template is not None:
        fast.chat_template = template
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    return len(fast)


def write_family_checkpoint(path: Path, model_type: str, *, vocab_size: int = 48, seed: int = 0,
                            max_shard_size: str = "40KB", hub_config: dict | None = None, **overrides) -> Path:
    """config.json, generation_config.json and sharded bf16 safetensors of a tiny `model_type` model in `path`
    (its tokenizer is write_tokenizer's, written separately). hub_config: keys that replace config.json's as
    written (a Hub file's legacy names, such as `rope_scaling` for `rope_parameters`)."""
    import torch
    import transformers
    from transformers import GenerationConfig

    config_name, model_name, extra = FAMILIES[model_type]
    config = getattr(transformers, config_name)(**{**COMMON, **extra, "vocab_size": vocab_size, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config)
    model.generation_config = GenerationConfig(**GENERATION)
    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size=max_shard_size)
    if hub_config is not None:
        written = json.loads((path / "config.json").read_text())
        written = {k: v for k, v in written.items() if k not in hub_config.get("_drop", ())}
        written.update({k: v for k, v in hub_config.items() if k != "_drop"})
        (path / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    return path


MXFP4_QUANTIZATION = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                 "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}


def write_mxfp4_gpt_oss(path: Path, vocab_size: int) -> Path:
    """A tiny gpt-oss checkpoint stored as the Hub's is: its experts in MXFP4 (`experts.gate_up_proj_blocks` uint8
    [E, out, in / 32, 16] and `_scales` [E, out, in / 32], drawn at random; scale 127 = 2^0), the rest bf16, and
    config.json's quantization_config; one safetensors file."""
    import torch
    from safetensors.torch import load_file, save_file

    write_family_checkpoint(path, "gpt_oss", vocab_size=vocab_size)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for f in sorted(set(index.values())):
        tensors.update(load_file(str(path / f)))
        (path / f).unlink()
    (path / "model.safetensors.index.json").unlink()
    g = torch.Generator().manual_seed(0)
    stored = {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, rows, cols = t.shape  # [E, in, out]
            stored[name + "_blocks"] = torch.randint(0, 256, (experts, cols, rows // 32, 16), generator=g,
                                                     dtype=torch.uint8)
            stored[name + "_scales"] = torch.full((experts, cols, rows // 32), 127, dtype=torch.uint8)
        else:
            stored[name] = t
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4_QUANTIZATION}, indent=2))
    return path
