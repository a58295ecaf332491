"""final/ is the user's model: the checkpoint's config.json apart from what training changed (the dtype trained in,
YaRN as trained, model_init_kwargs), `output_router_logits` as the user had it, safetensors sharded as
save_pretrained shards them with model.safetensors.index.json, a Qwen3-MoE in the Hub's per-expert layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_utils import JOB_TIMEOUT_S, ROOT, job_failure, train_env
from tests.tiny_checkpoint import MOE_HUB_CONFIG, write_documents, write_moe_checkpoint
from ulysses_trainer.config import TrainConfig
from ulysses_trainer.config.checks import shard_bytes
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.model.export_config import export_config_json
from ulysses_trainer.model.load import model_config_for

INDEX = "model.safetensors.index.json"
WRITTEN_BY = ("transformers_version",)  # the version that wrote the file: the exporter's


def _cfg(path: Path, **kw) -> TrainConfig:
    return TrainConfig(model_name_or_path=str(path), max_length=kw.pop("max_length", 64), **kw)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return write_moe_checkpoint(tmp_path_factory.mktemp("ckpt") / "moe")


def _without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def test_exported_config_is_the_checkpoints_own_with_the_trained_dtype(moe):
    cfg = _cfg(moe)
    trained = model_config_for(cfg)
    assert trained.output_router_logits is True and trained.use_cache is False  # what the run trains with
    out = export_config_json(cfg, trained, bf16=False)
    assert _without(out, *WRITTEN_BY) == {**_without(MOE_HUB_CONFIG, *WRITTEN_BY), "torch_dtype": "float32"}
    assert export_config_json(cfg, trained, bf16=True)["torch_dtype"] == "bfloat16"


def test_yarn_and_model_init_kwargs_are_exported_as_trained(moe):
    from transformers import AutoConfig

    cfg = _cfg(moe, max_length=2048, model_init_kwargs={"rope_parameters": {"rope_type": "yarn", "factor": "auto"},
                                                        "output_router_logits": True, "router_aux_loss_coef": 0.01})
    trained = model_config_for(cfg)
    out = export_config_json(cfg, trained, bf16=True)
    assert out["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                      "original_max_position_embeddings": 512}
    assert "rope_scaling" not in out and out["max_position_embeddings"] == 2048
    assert out["output_router_logits"] is True and out["router_aux_loss_coef"] == 0.01
    assert out["use_cache"] is True and out["num_experts"] == 4 and "num_local_experts" not in out
    d = moe.parent / "yarn_config"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(out))
    reloaded = AutoConfig.from_pretrained(d)  # transformers reads it back to the trained rope
    assert dict(reloaded.rope_parameters) == {**out["rope_parameters"]}
    assert reloaded.max_position_embeddings == 2048


def test_a_presets_export_keeps_its_output_router_logits():
    from ulysses_trainer.families import PRESETS
    from ulysses_trainer.families.presets import preset_config

    name = next(p for p in PRESETS if preset_config(p).model_type == "qwen3_moe")
    cfg = TrainConfig(model_name_or_path=name, max_length=64)
    out = export_config_json(cfg, model_config_for(cfg), bf16=True)
    assert out["output_router_logits"] is preset_config(name).output_router_logits
    assert out["dtype"] == "bfloat16" and "torch_dtype" not in out


@pytest.mark.parametrize("size,ok", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("40KiB", 40 * 1024), ("5", 0),
                                     ("lots", 0), (True, 0)])
def test_max_shard_size_reads_as_transformers_reads_it(size, ok):
    from transformers.utils.hub import convert_file_size_to_int

    assert shard_bytes(size) == ok
    if ok:
        assert convert_file_size_to_int(size) == ok


def test_a_malformed_max_shard_size_is_refused():
    from ulysses_trainer.config.checks import validate_config

    with pytest.raises(ConfigError, match="max_shard_size must be a size like 5GB"):
        validate_config(TrainConfig(max_shard_size="5 gigs"), 1)


@pytest.mark.slow
def test_per_expert_moe_trains_and_exports_sharded_as_the_hub_stores_it(moe, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    docs = write_documents(tmp_path / "docs.jsonl", num_docs=8, words_per_doc=31)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "launch/train.py", "--model_name_or_path", str(moe), "--dataset_name",
                           str(docs), "--max_length", "32", "--max_steps", "1", "--learning_rate", "1e-2",
                           "--max_shard_size", "40KB", "--output_dir", str(out)],
                          cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, job_failure(proc)
    final = out / "final"

    # sharded with the index, every tensor in the Hub's names (experts one by one, the router as mlp.gate)
    index = json.loads((final / INDEX).read_text())["weight_map"]
    files = sorted(set(index.values()))
    assert len(files) > 1 and all((final / f).is_file() for f in files)
    assert not (final / "model.safetensors").exists()
    assert set(index) == set(json.loads((moe / INDEX).read_text())["weight_map"])

    # config.json: the checkpoint's, apart from the dtype trained in (fp32 on CPU)
    written = json.loads((final / "config.json").read_text())
    original = json.loads((moe / "config.json").read_text())
    assert _without(written, *WRITTEN_BY) == {**_without(original, *WRITTEN_BY), "torch_dtype": "float32"}
    assert written["output_router_logits"] is False

    # plain transformers reloads it to the trained model: the same logits as the weights of the run's own
    # last checkpoint (its ZeRO-3 fp32 state), which differ from the checkpoint trained from
    exported = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    state = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoint-1"), tag="ds")
    state = {k.removeprefix("causal_lm."): v for k, v in state.items()}
    rebuilt = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(final), dtype=torch.float32,
                                               attn_implementation="sdpa")
    missing, unexpected = rebuilt.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    before = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32).eval()
    ids = torch.randint(0, 32, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want, start = (m.eval()(input_ids=ids).logits for m in (exported, rebuilt, before))
    assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()
    assert (got - start).abs().max() > 1e-3  # the step changed the model

    # the tokenizer travels as loaded
    text = "alpha bravo zulu"
    assert AutoTokenizer.from_pretrained(final)(text)["input_ids"] == AutoTokenizer.from_pretrained(moe)(text)[
        "input_ids"]


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_generation_config_is_the_checkpoints_own_with_the_turn_end_first_for_chat(tmp_path, chat):
    """final/generation_config.json is the checkpoint's file (Qwen3's sampling settings kept: do_sample,
    temperature 0.6, top_p 0.95, top_k 20, pad), not transformers' rendering of the config (token ids only); a
    chat export puts <|im_end|> first among its eos ids."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from tests.qwen3_checkpoint import QWEN3_GENERATION, write_qwen3_checkpoint
    from ulysses_trainer.data.qwen3_template import QWEN3_CHAT_TEMPLATE
    from ulysses_trainer.data.tokenizer import load_tokenizer
    from ulysses_trainer.train.chat_export import ExportFiles
    from ulysses_trainer.train.export import _write_export

    base = {**QWEN3_GENERATION, "eos_token_id": 151643}  # a base checkpoint's: <|endoftext|> alone
    ckpt = write_qwen3_checkpoint(tmp_path / "ckpt", QWEN3_CHAT_TEMPLATE, generation=base)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    state = {"causal_lm." + k: v for k, v in model.state_dict().items()}
    final = tmp_path / "final"
    files = ExportFiles(load_tokenizer(str(ckpt)), chat=chat, source=str(ckpt))
    _write_export(state, model.config, str(final) + ".tmp", str(final), files, "causal_lm.", source_dir=str(ckpt))
    written = json.loads((final / "generation_config.json").read_text())
    assert written == ({**base, "eos_token_id": [151645, 151643]} if chat else base)
    assert GenerationConfig.from_pretrained(final).top_k == 20


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_sharded_checkpoint_exports_in_its_own_files_and_index(tmp_path, stored):
    """max_shard_size unset: final/ holds the checkpoint's files (3 shards: 3 files, each tensor in the file its
    index names), not save_pretrained's 5GB single file; an fp32 export of a bf16 checkpoint keeps them too. Its
    tokenizer_config.json is the checkpoint's keys, without from_pretrained's loading arguments."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.tiny_checkpoint import write_checkpoint
    from ulysses_trainer.data.tokenizer import LOADER_KEYS, load_tokenizer
    from ulysses_trainer.train.chat_export import ExportFiles
    from ulysses_trainer.train.export import _write_export

    ckpt = write_checkpoint(tmp_path / "ckpt", dtype=stored, max_shard_size="150KB" if stored == torch.float32
                            else "75KB")
    source = json.loads((ckpt / INDEX).read_text())["weight_map"]
    assert len(set(source.values())) == 3
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    state = {"causal_lm." + k: v + 1 for k, v in model.state_dict().items()}  # trained: other values
    final = tmp_path / "final"
    files = ExportFiles(load_tokenizer(str(ckpt)), chat=False, source=str(ckpt))
    _write_export(state, model.config, str(final) + ".tmp", str(final), files, "causal_lm.", source_dir=str(ckpt))
    index = json.loads((final / INDEX).read_text())
    assert index["weight_map"] == source
    assert not (final / "model.safetensors").exists()
    assert sorted(p.name for p in final.glob("*.safetensors")) == sorted(set(source.values()))
    for name, f in source.items():
        with safe_open(str(final / f), framework="pt") as handle:
            assert torch.equal(handle.get_tensor(name), state["causal_lm." + name]), name
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in state.values())
    reloaded = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert all(torch.equal(v, state["causal_lm." + k]) for k, v in reloaded.state_dict().items())

    written = json.loads((final / "tokenizer_config.json").read_text())
    assert not set(written) & set(LOADER_KEYS), written
    assert set(written) == set(json.loads((ckpt / "tokenizer_config.json").read_text()))
    text = "alpha bravo zulu"
    assert AutoTokenizer.from_pretrained(final)(text)["input_ids"] == AutoTokenizer.from_pretrained(ckpt)(text)[
        "input_ids"]


def test_a_set_max_shard_size_cuts_the_export_as_given(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.tiny_checkpoint import write_checkpoint
    from ulysses_trainer.data.tokenizer import load_tokenizer
    from ulysses_trainer.train.chat_export import ExportFiles
    from ulysses_trainer.train.export import _write_export

    ckpt = write_checkpoint(tmp_path / "ckpt", max_shard_size="150KB")
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    state = {"causal_lm." + k: v for k, v in model.state_dict().items()}
    final = tmp_path / "final"
    _write_export(state, model.config, str(final) + ".tmp", str(final),
                  ExportFiles(load_tokenizer(str(ckpt)), chat=False, source=str(ckpt)), "causal_lm.",
                  max_shard_size="5GB", source_dir=str(ckpt))
    assert (final / "model.safetensors").is_file() and not (final / INDEX).exists()
