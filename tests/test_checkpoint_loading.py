"""A checkpoint loads completely or the run does not start: every tensor of the checkpoint is used and every
parameter of the model is loaded (names after transformers' renaming and Qwen3-MoE's expert fusion), else exit
2 with one `error:` line naming keys, before any heavy work and with nothing written.

The checkpoints are tiny but in the real layouts: a dense Qwen3 in bf16 over several safetensors files with
model.safetensors.index.json, and a Qwen3-MoE in the Hub's per-expert layout with the Hub's config.json keys.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_checkpoint import write_checkpoint, write_documents, write_moe_checkpoint
from ulysses_trainer.cli.train import main
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.model.load import check_local_weights, load_model_config

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("checkpoints")
    return {"moe": write_moe_checkpoint(d / "moe"),
            "dense": write_checkpoint(d / "dense", dtype=torch.bfloat16, max_shard_size="40KB"),
            "tied": write_checkpoint(d / "tied", tie_word_embeddings=True),
            "docs": write_documents(d / "docs.jsonl", num_docs=8, words_per_doc=31)}


def _edit(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint `src` whose tensors `edit(name, tensor)` renames/reshapes/drops (returns a list of
    (name, tensor) pairs), with the index kept consistent, as a tool that re-saved it would leave it."""
    shutil.copytree(src, dst)
    index = json.loads((dst / INDEX).read_text())
    weight_map = {}
    for f in sorted(set(index["weight_map"].values())):
        tensors = dict(kv for k, v in load_file(dst / f).items() for kv in edit(k, v))
        save_file(tensors, dst / f, metadata={"format": "pt"})
        weight_map.update({k: f for k in tensors})
    index["weight_map"] = weight_map
    (dst / INDEX).write_text(json.dumps(index))
    return dst


def _train(argv: list[str], monkeypatch, capsys) -> tuple[int, list[str]]:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    rc = main(argv)
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def _refused(checkpoint: Path, good, tmp_path, monkeypatch, capsys) -> str:
    out = tmp_path / "out"
    rc, errors = _train(["--model_name_or_path", str(checkpoint), "--dataset_name", str(good["docs"]),
                         "--max_length", "32", "--max_steps", "1", "--output_dir", str(out)], monkeypatch, capsys)
    assert rc == 2 and len(errors) == 1, errors
    assert not out.exists()
    return errors[0]


@pytest.mark.parametrize("name", ["moe", "dense", "tied"])
def test_complete_checkpoints_pass(name, good):
    """The per-expert layout (fused by transformers on load) and tied embeddings are not false alarms."""
    path = str(good[name])
    check_local_weights(path, load_model_config(path))


def test_a_renamed_moe_router_is_refused_naming_both_keys(good, tmp_path, monkeypatch, capsys):
    bad = _edit(good["moe"], tmp_path / "renamed",
                lambda k, v: [(k.replace("layers.1.mlp.gate.", "layers.1.mlp.router."), v)])
    error = _refused(bad, good, tmp_path, monkeypatch, capsys)
    assert "1 tensors the model needs are missing (model.layers.1.mlp.gate.weight)" in error
    assert "1 checkpoint tensors are not used by the model (model.layers.1.mlp.router.weight)" in error
    assert "random" in error and "Fix the checkpoint" in error


def test_a_missing_shard_is_refused_naming_the_file_and_its_tensors(good, tmp_path, monkeypatch, capsys):
    bad = tmp_path / "no_shard"
    shutil.copytree(good["moe"], bad)
    weight_map = json.loads((bad / INDEX).read_text())["weight_map"]
    lost = sorted(set(weight_map.values()))[1]
    (bad / lost).unlink()
    error = _refused(bad, good, tmp_path, monkeypatch, capsys)
    held = sorted(k for k, f in weight_map.items() if f == lost)
    assert lost in error and f"holding {len(held)} tensors: {held[0]}" in error, error
    assert "copy the whole checkpoint" in error


def test_a_wrong_shape_is_refused_naming_both_shapes(good, tmp_path, monkeypatch, capsys):
    bad = _edit(good["dense"], tmp_path / "shape",
                lambda k, v: [(k, v[:-1] if k == "model.layers.1.self_attn.o_proj.weight" else v)])
    error = _refused(bad, good, tmp_path, monkeypatch, capsys)
    assert "model.layers.1.self_attn.o_proj.weight [63, 128] where the model has [64, 128]" in error, error


def test_a_dropped_expert_and_an_extra_tensor_are_refused(good, tmp_path, monkeypatch, capsys):
    def edit(k, v):
        if k == "model.layers.0.mlp.experts.3.up_proj.weight":
            return []
        extra = [("model.layers.0.mlp.shared_expert.weight", v.clone())] if k.endswith("0.mlp.gate.weight") else []
        return [(k, v), *extra]

    error = _refused(_edit(good["moe"], tmp_path / "dropped", edit), good, tmp_path, monkeypatch, capsys)
    assert "not used by the model (model.layers.0.mlp.shared_expert.weight)" in error, error
    # the fused gate_up_proj of layer 0 cannot be built from 3 up_proj tensors: named, whatever way
    # transformers reports it (a missing fused key, a wrong shape or a failed fusion)
    assert re.search(r"model\.layers\.0\.mlp\.experts\.gate_up_proj\b", error), error


def test_index_naming_tensors_its_files_lack_is_refused(good, tmp_path):
    bad = tmp_path / "index"
    shutil.copytree(good["dense"], bad)
    index = json.loads((bad / INDEX).read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = sorted(set(index["weight_map"].values()))[0]
    (bad / INDEX).write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"tensors named by model\.safetensors\.index\.json are in none of its "
                                          r"files \(model\.layers\.9\.mlp\.up_proj\.weight\)"):
        check_local_weights(str(bad), load_model_config(str(bad)))


def test_the_model_init_kwargs_model_is_what_the_checkpoint_is_checked_against(good, tmp_path):
    """num_hidden_layers below the checkpoint's keeps its first layers (the rest dropped on purpose, nothing
    random); a renamed tensor in a kept layer is still refused, one in a dropped layer is not loaded anyway."""
    path = str(good["dense"])
    check_local_weights(path, load_model_config(path, {"num_hidden_layers": 1}))
    kept = _edit(good["dense"], tmp_path / "kept",
                 lambda k, v: [(k.replace("layers.0.mlp.up_proj", "layers.0.mlp.up"), v)])
    with pytest.raises(ConfigError, match=r"not used by the model \(model\.layers\.0\.mlp\.up\.weight\)"):
        check_local_weights(str(kept), load_model_config(str(kept), {"num_hidden_layers": 1}))
    dropped = _edit(good["dense"], tmp_path / "dropped",
                    lambda k, v: [(k.replace("layers.1.mlp.up_proj", "layers.1.mlp.up"), v)])
    check_local_weights(str(dropped), load_model_config(str(dropped), {"num_hidden_layers": 1}))
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):  # all layers: refused
        check_local_weights(str(dropped), load_model_config(str(dropped)))
