"""Tiny Qwen3.5 checkpoint directories in the layouts the Hub has them, for the load and export tests.

- `conditional` (what Qwen/Qwen3.5-* ship): `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`,
  config.json with `text_config` + `vision_config`; tensors `model.language_model.*`, `model.visual.*`, `lm_head.*`
  and the multi-token-prediction head `mtp.*` (which transformers does not load); the MoE language model's experts
  fused (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) and the MTP layer's experts one by one, as
  Qwen/Qwen3.5-35B-A3B stores them. bf16, two safetensors shards with model.safetensors.index.json; a tokenizer
  (tokenizer.json beside vocab.json and merges.txt) with a chat template, generation_config.json as Qwen3.5 ships
  it (sampling settings), the image and video preprocessor files and the processor's own chat template
  (chat_template.json, which AutoProcessor reads before chat_template.jinja; another template here, so that a test
  sees which one a loader took).
- `causal`: a text-only `Qwen3_5ForCausalLM` directory as transformers saves one (config `qwen3_5_text`, tensors
  under `model.language_model.*`).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from tests.tiny_checkpoint import WORDS

VOCAB = 384
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=512,
            tie_word_embeddings=False, mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
            bos_token_id=0, eos_token_id=0, pad_token_id=0)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
           router_aux_loss_coef=0.001)
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=16)
GENERATION = {"bos_token_id": 0, "do_sample": True, "eos_token_id": [0, 1], "pad_token_id": 0, "temperature": 0.6,
              "top_k": 20, "top_p": 0.95, "transformers_version": "4.57.0.dev0"}
PREPROCESSOR = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                "image_processor_type": "Qwen2VLImageProcessorFast"}
VIDEO_PREPROCESSOR = {**PREPROCESSOR, "fps": 2, "video_processor_type": "Qwen3VLVideoProcessor"}
TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
PROCESSOR_TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                      "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{%- endif %}")
INDEX = "model.safetensors.index.json"


def _mtp(moe: bool, text_cls, text_config):
    """An MTP head as Qwen3.5 stores it: fc over [embedding; hidden], its norms, one decoder layer (full
    attention; a MoE layer's experts one by one)."""
    import torch

    h = text_config.hidden_size
    layer_cfg = text_config.__class__(**{**text_config.to_dict(), "num_hidden_layers": 1,
                                         "layer_types": ["full_attention"]})
    layer = text_cls(layer_cfg).layers[0]
    out = {f"mtp.layers.0.{k}": v for k, v in layer.state_dict().items() if ".experts." not in k}
    if moe:
        e, i = text_config.num_experts, text_config.moe_intermediate_size
        for x in range(e):
            out[f"mtp.layers.0.mlp.experts.{x}.gate_proj.weight"] = torch.randn(i, h)
            out[f"mtp.layers.0.mlp.experts.{x}.up_proj.weight"] = torch.randn(i, h)
            out[f"mtp.layers.0.mlp.experts.{x}.down_proj.weight"] = torch.randn(h, i)
    out.update({"mtp.fc.weight": torch.randn(h, 2 * h), "mtp.norm.weight": torch.ones(h),
                "mtp.pre_fc_norm_embedding.weight": torch.ones(h), "mtp.pre_fc_norm_hidden.weight": torch.ones(h)})
    return out


def write_qwen3_5_checkpoint(path: Path, *, moe: bool = False, layout: str = "conditional", seed: int = 0,
                             mtp: bool = True, tie: bool = False, processor_template: str | None = PROCESSOR_TEMPLATE,
                             tokenizer_template: str | None = TEMPLATE) -> Path:
    """A tiny Qwen3.5 (dense or MoE) checkpoint directory in `layout` ("conditional" or "causal"), see above.
    processor_template: the conditional layout's chat_template.json (None: none); tokenizer_template: the
    tokenizer's chat_template.jinja (None: the tokenizer has no template, as where only the processor has one)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    kind = "Qwen3_5Moe" if moe else "Qwen3_5"
    text_kwargs = {**TEXT, **(MOE if moe else {}), "tie_word_embeddings": tie}
    text_config = getattr(transformers, f"{kind}TextConfig")(**text_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if layout == "conditional":
            config = getattr(transformers, f"{kind}Config")(text_config=text_kwargs, vision_config=VISION,
                                                           tie_word_embeddings=tie)
            model = getattr(transformers, f"{kind}ForConditionalGeneration")(config)
            state = dict(model.state_dict())  # as held: the language model's experts fused, as the Hub stores them
        else:
            config = text_config
            model = getattr(transformers, f"{kind}ForCausalLM")(config)
            state = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                     for k, v in model.state_dict().items()}
            if moe:  # transformers saves a text-only MoE's experts one by one
                for k in [k for k in state if k.endswith("mlp.experts.gate_up_proj")]:
                    base, (gate_up, down) = k[:-len("gate_up_proj")], (state.pop(k), state.pop(
                        k[:-len("gate_up_proj")] + "down_proj"))
                    i = gate_up.shape[1] // 2
                    for x in range(gate_up.shape[0]):
                        state[f"{base}{x}.gate_proj.weight"] = gate_up[x, :i]
                        state[f"{base}{x}.up_proj.weight"] = gate_up[x, i:]
                        state[f"{base}{x}.down_proj.weight"] = down[x]
        if tie:
            state.pop("lm_head.weight", None)
        if mtp:
            module = "qwen3_5_moe" if moe else "qwen3_5"
            modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
            state.update(_mtp(moe, getattr(modeling, f"{kind}TextModel"), text_config))
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items()}
    names = sorted(state)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves):
        f = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, str(path / f), metadata={"format": "pt"})
        weight_map.update({k: f for k in part})
    total = sum(v.numel() * v.element_size() for v in state.values())
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config_json = config.to_dict()
    config_json["architectures"] = [f"{kind}ForConditionalGeneration" if layout == "conditional"
                                    else f"{kind}ForCausalLM"]
    config_json["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True))
    (path / "generation_config.json").write_text(json.dumps(GENERATION, indent=2))
    if layout == "conditional":
        (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
        (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR, indent=2))
        if processor_template is not None:
            (path / "chat_template.json").write_text(json.dumps({"chat_template": processor_template}, indent=2))
    _write_tokenizer(path, tokenizer_template)
    return path


def _write_tokenizer(path: Path, template: str | None = TEMPLATE) -> None:
    """A byte-level BPE with Qwen3.5's pre-tokenizer, trained on the test words (each a token or two), eos
    <|endoftext|> = 0: transformers loads a qwen3_5 directory's tokenizer as Qwen3_5Tokenizer, which reads a BPE."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = template
    fast.save_pretrained(str(path))
    tok.model.save(str(path))  # vocab.json and merges.txt, which the Hub's Qwen3.5 directories ship too
