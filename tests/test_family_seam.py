"""A model family is one module: a test-only family (tests/plain_mlp_family.py, Qwen3 with a plain two-Linear MLP)
registered here is planned, loaded, parallelized and trained one step on CPU without editing the package; and
nothing outside families/ branches on which family (or MLP kind) a model has."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from tests.plain_mlp_family import (
    MODEL_TYPE,
    PLAIN,
    PRESET,
    PlainConfig,
    PlainForCausalLM,
    PlainMLP,
    register_plain,
    unregister_plain,
)
from tests.sp_rank import trainer_path_matches
from ulysses_trainer import ParallelizeConfig, parallelize
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.families import FAMILIES, family, preset_family, register
from ulysses_trainer.model.load import build_model
from ulysses_trainer.parallel.state import single_process_state
from ulysses_trainer.plan.counts import layer_param_numels, num_params
from ulysses_trainer.plan.inputs import ModelShape, Settings
from ulysses_trainer.plan.layer_terms import layer_forward_saved, mlp_backward_extra
from ulysses_trainer.plan.partitions import lora_numels
from ulysses_trainer.plan.zero3_trace import forward_order, gathers_per_micro_step

PKG = Path(__file__).resolve().parent.parent / "ulysses_trainer"
FAMILY_NAMES = {"qwen3", "qwen3_moe", "dense", "sparse"}  # model types and the MLP kinds they had


@pytest.fixture
def plain_family():
    register_plain()
    try:
        yield PLAIN
    finally:
        unregister_plain()


def _config():
    from ulysses_trainer.families.presets import preset_config

    return preset_config(PRESET)


def test_the_planner_reads_the_new_familys_block(plain_family):
    shape = ModelShape.preset(PRESET)
    h, i = 64, 96
    assert layer_param_numels(shape)[6:8] == [h * i, i * h]  # after q, k, v, o, q_norm, k_norm: up, down
    assert forward_order(shape)[-2:] == ["up", "down"]
    assert gathers_per_micro_step(shape, persistence_threshold=0)["up"] >= 2
    s = Settings(max_length=4096).with_levers(tiled_mlp=1)
    saved = layer_forward_saved(shape, s)
    assert saved["plain MLP intermediates (up, act)"] == 2 * 4096 * i * 2
    assert "MLP intermediates (gate, act, up, product)" not in saved
    assert "plain MLP backward: grad of act, input grad" in mlp_backward_extra(shape, s)
    per_layer = lora_numels(shape, "all-linear", 4)[:12]  # q, k, v, o, up, down: A and B each
    assert per_layer[-4:] == (4 * h, i * 4, 4 * i, h * 4)
    with torch.device("meta"):
        model = PlainForCausalLM(_config())
    assert sum(p.numel() for p in model.parameters()) == num_params(shape)


def test_the_plan_command_plans_it(plain_family, capsys):
    from ulysses_trainer.__main__ import main as cli_main

    assert cli_main(["plan", "--model", PRESET, "--max_length", "4096", "--gpus", "2", "--gpu_memory_gb", "80",
                     "--host_memory_gb", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["estimate"]["parameters"] == num_params(ModelShape.preset(PRESET))


def test_the_trainers_model_path_runs_it_and_matches_transformers(plain_family):
    """model_config_for -> plan_for -> build_model -> parallelize -> one forward/backward = the HF model's own."""
    sp_model = trainer_path_matches(PRESET, 32)
    model = sp_model.causal_lm
    assert isinstance(model, PlainForCausalLM) and sp_model.router_stats is None
    assert isinstance(model.model.layers[0].mlp, PlainMLP)  # the family's install kept its own MLP


def test_registering_refuses_a_taken_name(plain_family):
    with pytest.raises(ValueError, match="already registered"):
        register(PLAIN)
    assert FAMILIES[MODEL_TYPE] is PLAIN


def _registered() -> dict[str, bool]:
    """Where the test family can be found: the family registry, its presets, transformers' Auto maps."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from tests.plain_mlp_family import PlainMlp
    from ulysses_trainer.families.installs import installer

    try:
        installed = installer(PlainMlp()) is not None
    except ConfigError:
        installed = False
    return {"families": MODEL_TYPE in FAMILIES, "presets": preset_family(PRESET) is not None, "install": installed,
            "auto config": MODEL_TYPE in CONFIG_MAPPING, "auto causal lm": PlainConfig in MODEL_FOR_CAUSAL_LM_MAPPING}


def test_unregistering_leaves_nothing_registered():
    """After unregister the package and transformers know the family no more, and it registers again cleanly
    (each register raises on a name still taken)."""
    from transformers import AutoConfig

    from ulysses_trainer.families.presets import preset_config

    assert not any(_registered().values()), _registered()
    for _ in range(2):
        register_plain()
        assert all(_registered().values()), _registered()
        assert type(preset_config(PRESET)) is PlainConfig
        unregister_plain()
        assert not any(_registered().values()), _registered()
    with pytest.raises(ConfigError, match="not supported"):
        family(MODEL_TYPE)
    with pytest.raises(ConfigError, match="unknown model preset"):
        preset_config(PRESET)
    with pytest.raises(ValueError, match="Unrecognized model identifier"):
        AutoConfig.for_model(MODEL_TYPE)


def _family_branches(tree: ast.AST) -> list[str]:
    """Where code asks which family or MLP kind it has: `.mlp_kind` / `.sparse`, or a comparison with a model
    type's or an MLP kind's name, or of a `.model_type` with a literal."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("mlp_kind", "sparse"):
            out.append(f"line {node.lineno}: .{node.attr}")
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = [s.value for s in sides if isinstance(s, ast.Constant) and s.value in FAMILY_NAMES]
            typed = any(isinstance(s, ast.Attribute) and s.attr == "model_type" for s in sides)
            literal = any(isinstance(s, (ast.Constant, ast.Tuple, ast.List, ast.Set)) for s in sides)
            if named or (typed and literal):  # `model_type in FAMILIES` asks whether it is known, not which
                out.append(f"line {node.lineno}: compares {named or 'model_type'}")
    return out


def test_the_walker_sees_a_family_branch():
    assert _family_branches(ast.parse("if fam.mlp_kind == 'sparse': pass"))
    assert _family_branches(ast.parse("x = 1 if shape.sparse else 2"))
    assert _family_branches(ast.parse("if config.model_type in ('a', 'b'): pass"))
    assert _family_branches(ast.parse("if kind != 'dense': pass"))
    assert not _family_branches(ast.parse("fam = family(getattr(config, 'model_type', 'qwen3'))"))
    assert not _family_branches(ast.parse("if config.model_type not in FAMILIES: pass"))


def test_no_family_branch_outside_the_families():
    found = {}
    for path in PKG.rglob("*.py"):
        if (PKG / "families") in path.parents:
            continue
        hits = _family_branches(ast.parse(path.read_text()))
        if hits:
            found[str(path.relative_to(PKG))] = hits
    assert found == {}, f"ask the family (families/) instead: {found}"


def test_a_block_missing_part_of_its_behaviour_is_refused_when_it_is_made():
    """MlpBlock's abstract methods: a family's block without any of params, saved, backward_extra or
    weight_grad_numel fails when the family module makes it, not later inside the plan."""
    from tests.plain_mlp_family import PlainMlp
    from ulysses_trainer.families.base import MlpBlock

    needed = ("params", "saved", "backward_extra", "weight_grad_numel")
    missing = {name for name in (*needed, "time_parts", "dims")
               if getattr(getattr(MlpBlock, name), "__isabstractmethod__", False)}
    assert missing == set(needed)
    without_saved = type("NoSaved", (MlpBlock,), {n: getattr(PlainMlp, n) for n in missing - {"saved"}})
    with pytest.raises(TypeError, match="saved"):
        without_saved()
    PlainMlp()  # the whole behaviour: made


def test_a_block_without_an_install_is_refused_before_the_model_changes(plain_family):
    """parallelize asks families/installs.py for the block's install before it touches the model: a family whose block
    has none registered is a ConfigError naming register_install, and the model is left as it was."""
    from tests.plain_mlp_family import PlainMlp, install_plain
    from ulysses_trainer.families.installs import register_install, unregister_install

    model = build_model(_config(), torch.float32, seed=5)
    before, attn, config = {n: p.clone() for n, p in model.state_dict().items()}, model.config._attn_implementation, \
        model.config
    unregister_install(PlainMlp)
    try:
        with pytest.raises(ConfigError, match="register_install"):
            parallelize(model, single_process_state(), ParallelizeConfig(gradient_checkpointing=False))
    finally:
        register_install(PlainMlp, install_plain)
    assert isinstance(model.model.layers[0].mlp, PlainMLP) and model.config is config
    assert model.config._attn_implementation == attn
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    with pytest.raises(ValueError, match="already"):
        register_install(PlainMlp, install_plain)
