"""final/ of a checkpoint of the families beyond Qwen is in the checkpoint's own layout: its tensor names (Phi-3's
fused qkv_proj and gate_up_proj, Mixtral's experts one by one under block_sparse_moe, gpt-oss's fused experts with
their biases, router and sinks, Gemma 3's tied embedding), its files and index (the source's shards: its largest
file's size), its config.json key for key (a Hub file's legacy `rope_scaling` and `rope_theta` as written, the dtype
trained in apart), its generation_config.json and its tokenizer files without loader-only keys.

The trained weights are the trainer's model path's (model_config_for, build_model, parallelize: the names the
ZeRO-3 consolidation gives the export), each tensor changed as a step would; the writer is the one the trainer's
rank 0 runs (train/export._write_export). AutoModelForCausalLM.from_pretrained of final/ gives the trained tensors
exactly, under the source's names.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.family_checkpoints import GENERATION, write_family_checkpoint, write_tokenizer
from tests.test_family_templates import GEMMA_LIKE, GEMMA_SPECIALS, LLAMA31_LIKE, LLAMA_SPECIALS

INDEX = "model.safetensors.index.json"
# Hub config.json keys as the published checkpoints write them (transformers 4.x names), shrunk
LLAMA_HUB = {"rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                              "original_max_position_embeddings": 32, "rope_type": "llama3"},
             "rope_theta": 500000.0, "torch_dtype": "bfloat16", "_drop": ("rope_parameters", "dtype")}
GEMMA_HUB = {"rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "rope_theta": 1000000.0,
             "rope_local_base_freq": 10000.0, "torch_dtype": "bfloat16", "_drop": ("rope_parameters", "dtype")}
CASES = {  # id: (model_type, config overrides, Hub config keys, the tokenizer's specials and template)
    "phi3-fused": ("phi3", {}, None, (), None),
    "mixtral-experts": ("mixtral", {}, None, (), None),
    "qwen2-moe-shared-expert": ("qwen2_moe", {}, None, (), None),
    "mistral": ("mistral", {}, None, (), None),
    "ministral": ("ministral", {}, None, (), None),
    "qwen2-biases": ("qwen2", {}, None, (), None),
    "granite": ("granite", {}, None, (), None),
    "olmo2": ("olmo2", {}, None, (), None),
    "gpt-oss-experts-sinks": ("gpt_oss", {}, None, (), None),
    "gemma3-tied-hub-rope": ("gemma3_text", {"tie_word_embeddings": True}, GEMMA_HUB, GEMMA_SPECIALS, GEMMA_LIKE),
    "llama-hub-rope": ("llama", {}, LLAMA_HUB, LLAMA_SPECIALS, LLAMA31_LIKE),
}


def _stored(d: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def exported(request, tmp_path_factory):
    """(checkpoint, final/, the trained tensors by the causal LM's names)."""
    from ulysses_trainer import ParallelizeConfig, parallelize
    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.data.tokenizer import load_tokenizer
    from ulysses_trainer.model.export_config import export_config_json
    from ulysses_trainer.model.load import build_model, model_config_for
    from ulysses_trainer.parallel.state import single_process_state
    from ulysses_trainer.train.chat_export import ExportFiles
    from ulysses_trainer.train.export import _write_export

    model_type, overrides, hub, specials, template = CASES[request.param]
    ckpt = tmp_path_factory.mktemp(request.param) / "ckpt"
    vocab = write_tokenizer(ckpt, specials, template)
    write_family_checkpoint(ckpt, model_type, vocab_size=vocab, hub_config=hub, **overrides)
    if model_type == "gemma3_text":  # an instruct checkpoint's eos list, which holds its answer end already
        answer_end = load_tokenizer(str(ckpt)).special_token_id("<end_of_turn>")
        (ckpt / "generation_config.json").write_text(json.dumps({**GENERATION, "eos_token_id": [0, answer_end]}))
    cfg = TrainConfig(model_name_or_path=str(ckpt), max_length=32)
    config = model_config_for(cfg)
    sp_model = parallelize(build_model(config, torch.float32, str(ckpt)), single_process_state(),
                           ParallelizeConfig(attn_implementation="sdpa"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # what a training step does: every trained tensor changes (a tied one once)
        for p in sp_model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    state = {k: v.detach().clone() for k, v in sp_model.state_dict().items()}
    final = ckpt.parent / "final"
    files = ExportFiles(load_tokenizer(str(ckpt)), chat=template is not None, source=str(ckpt))
    _write_export(state, config, str(final) + ".tmp", str(final), files, "causal_lm.", None,
                  export_config_json(cfg, config, False), None, str(ckpt))
    return ckpt, final, {k.removeprefix("causal_lm."): v for k, v in state.items()}


def test_the_export_keeps_the_checkpoints_tensor_names_files_and_index(exported):
    ckpt, final, _ = exported
    src, out = _stored(ckpt), _stored(final)
    assert set(out) == set(src) and len(src) > 0
    assert {k: tuple(v.shape) for k, v in out.items()} == {k: tuple(v.shape) for k, v in src.items()}
    assert all(v.dtype == torch.float32 for v in out.values())  # the dtype trained in (fp32 on the CPU)
    index, source = (json.loads((d / INDEX).read_text()) for d in (final, ckpt))
    assert index["weight_map"] == source["weight_map"] and len(set(source["weight_map"].values())) > 2
    assert sorted(p.name for p in final.glob("*.safetensors")) == sorted(set(source["weight_map"].values()))


def test_from_pretrained_of_the_export_gives_the_trained_tensors_under_the_sources_names(exported):
    from transformers import AutoModelForCausalLM

    ckpt, final, trained = exported
    back = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).state_dict()
    before = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).state_dict()
    assert list(back) == list(before) == list(trained)
    for name, tensor in back.items():
        assert torch.equal(tensor, trained[name]), name
        assert not torch.equal(tensor, before[name]), name  # the trained weights, not the checkpoint's


def test_config_generation_config_and_tokenizer_are_the_checkpoints(exported):
    from transformers import AutoTokenizer

    from ulysses_trainer.data.tokenizer import LOADER_KEYS, load_tokenizer

    ckpt, final, _ = exported
    written, original = (json.loads((d / "config.json").read_text()) for d in (final, ckpt))
    dtype_key = "torch_dtype" if "torch_dtype" in original else "dtype"
    assert written[dtype_key] == "float32" and original[dtype_key] == "bfloat16"
    for c in (written, original):
        c.pop(dtype_key)
        c.pop("transformers_version", None)
    assert written == original  # model_type, architectures, the rope as the file wrote it, use_cache: the user's
    generation = json.loads((ckpt / "generation_config.json").read_text())
    if "<|eot_id|>" in (ckpt / "tokenizer.json").read_text():  # chat-trained from a base eos list: Llama's answer
        # end first among them, so generation stops where the template ends an answer
        generation["eos_token_id"] = [load_tokenizer(str(ckpt)).special_token_id("<|eot_id|>"), 0, 1]
    assert json.loads((final / "generation_config.json").read_text()) == generation  # Gemma's: as written
    assert generation["temperature"] == 0.6
    tok_written, tok_original = (json.loads((d / "tokenizer_config.json").read_text()) for d in (final, ckpt))
    # every key of the checkpoint's (a qwen2 directory's generic tokenizer re-saved as Qwen2's class adds its
    # add_prefix_space and bos_token), none of from_pretrained's loading arguments
    assert not set(tok_written) & set(LOADER_KEYS) and set(tok_original) <= set(tok_written)
    back, source = AutoTokenizer.from_pretrained(final), AutoTokenizer.from_pretrained(ckpt)
    assert back.chat_template == source.chat_template
    assert back.all_special_tokens == source.all_special_tokens
    assert back("alpha bravo zulu")["input_ids"] == source("alpha bravo zulu")["input_ids"]


def test_an_mxfp4_checkpoint_is_refused_naming_the_dequantize_step_whose_output_loads(tmp_path, capsys):
    """gpt-oss as the Hub stores it (MXFP4 experts, quantization_config): `plan` exits 2 in one line naming the
    one-time dequantize; the checkpoint that step writes (bf16 experts under their fused names, no
    quantization_config) is accepted and built, in the layout the export keeps (above)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from tests.family_checkpoints import write_mxfp4_gpt_oss
    from ulysses_trainer.__main__ import main as cli_main
    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.model.load import build_model, model_config_for

    quantized = write_mxfp4_gpt_oss(tmp_path / "mxfp4", write_tokenizer(tmp_path / "mxfp4"))
    capsys.readouterr()
    assert cli_main(["plan", "--model", str(quantized), "--gpus", "1", "--gpu_memory_gb", "80", "--host_memory_gb",
                     "64", "--max_length", "64"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "stored quantized (mxfp4)" in errors[0], errors
    assert "quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16).save_pretrained(OUT)" in errors[0]
    out = tmp_path / "bf16"  # the step the message names
    AutoModelForCausalLM.from_pretrained(quantized, quantization_config=Mxfp4Config(dequantize=True),
                                         dtype=torch.bfloat16).save_pretrained(out)
    config = model_config_for(TrainConfig(model_name_or_path=str(out), max_length=64))
    model = build_model(config, torch.float32, str(out))
    assert model.model.layers[0].mlp.experts.gate_up_proj.abs().max() > 0
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert {k for k in _stored(out) if ".mlp.experts." in k} == {
        f"model.layers.{i}.mlp.experts.{n}" for i in range(2)
        for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}
