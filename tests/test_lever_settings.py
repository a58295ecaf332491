"""The memory levers are decoded once (ulysses_trainer/vocabulary/lever_settings.py): the training config's checks, the
planner and a loop of your own (ParallelizeConfig) read one decoder, so one value means one thing everywhere."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from ulysses_trainer.cli import plan as plan_cli
from ulysses_trainer.config import TrainConfig
from ulysses_trainer.errors import EXIT_INVALID, ConfigError
from ulysses_trainer.families.presets import preset_config
from ulysses_trainer.model.parallelize import ParallelizeConfig, parallelize
from ulysses_trainer.plan.inputs import ModelShape
from ulysses_trainer.plan.resolve import resolve_plan
from ulysses_trainer.plan.types import Machine
from ulysses_trainer.vocabulary.layout import Layout
from ulysses_trainer.vocabulary.lever_settings import TRUE_TILES, decode_levers

PACKAGE = Path(__file__).resolve().parent.parent / "ulysses_trainer"
RAW_LEVERS = {"activation_offload", "keep_attention_outputs", "tiled_mlp", "checkpoint_every", "optimizer_offload"}
# where the raw fields may be read: the decoder, and the config's own definition with TRL's spellings, which
# config/trl.py maps onto its fields when a TrainConfig is made
DECODER = PACKAGE / "vocabulary" / "lever_settings.py"
DEFINITION = (PACKAGE / "config" / "train_config.py", PACKAGE / "config" / "trl.py")
CPU = Machine(gpus=1, gpu_memory_gb=None, host_memory_gb=64.0)

LEVER_VALUES = [
    {},
    {"tiled_mlp": False}, {"tiled_mlp": True}, {"tiled_mlp": 3},
    {"activation_offload": True}, {"activation_offload": 1}, {"activation_offload": False},
    {"keep_attention_outputs": 0}, {"keep_attention_outputs": True}, {"keep_attention_outputs": 1},
    {"checkpoint_every": 2}, {"gradient_checkpointing": False}, {"gradient_checkpointing": False, "tiled_mlp": 2},
]


@pytest.mark.parametrize("values", LEVER_VALUES)
def test_a_training_config_and_a_parallelize_config_decode_alike(values):
    assert decode_levers(TrainConfig(**values)) == ParallelizeConfig(**values).levers


def test_decoded_meanings():
    lv = decode_levers(TrainConfig(tiled_mlp=True, activation_offload=True, keep_attention_outputs=False))
    assert (lv.tiled_mlp, lv.activation_offload, lv.keep_attention_outputs, lv.checkpoint_every,
            lv.optimizer_offload) == (TRUE_TILES, "all", 0, None, None)
    off = decode_levers(TrainConfig(gradient_checkpointing=False, tiled_mlp=False))
    assert (off.tiled_mlp, off.activation_offload, off.keep_attention_outputs, off.checkpoint_every) == (1, 0, 0, 1)
    assert off.pinned == ("gradient_checkpointing", "tiled_mlp")


def test_tiled_mlp_0_is_refused_by_the_config_the_plan_and_a_loop_of_your_own(capsys):
    """0 tiles means nothing (1 or false is untiled): every reader refuses it with the same line."""
    msg = "tiled_mlp must be >= 1 tiles (or true/false/auto), got 0"
    rc = plan_cli.main(["--max_length", "4096", "--gpu_memory_gb", "80", "--host_memory_gb", "64", "--tiled_mlp", "0"])
    assert rc == EXIT_INVALID
    assert capsys.readouterr().err.strip() == f"error: {msg}"
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        resolve_plan(TrainConfig(tiled_mlp=0), ModelShape.from_config(preset_config("tiny")), CPU)
    with pytest.raises(ConfigError, match="tiled_mlp must be >= 1 tiles"):
        ParallelizeConfig(tiled_mlp=0).resolve(preset_config("tiny"))
    # the untiled spellings stay accepted by both
    assert ParallelizeConfig(tiled_mlp=1).resolve(preset_config("tiny")).levers.tiled_mlp == 1
    untiled = resolve_plan(TrainConfig(tiled_mlp=False), ModelShape.from_config(preset_config("tiny")), CPU)
    assert untiled.run.levers.tiled_mlp == 1


@pytest.mark.parametrize("ckpt, keep, stash", [
    (True, "auto", True), (True, True, True), (True, 1, True), (True, 0, False), (True, False, False),
    (False, "auto", False), (False, False, False),
])
def test_the_attention_stash_means_one_thing(ckpt, keep, stash):
    """The stash is installed where a layer may keep its attention output: the trainer's plan (Plan.model_setup)
    and a loop of your own (ParallelizeConfig) agree, and parallelize installs exactly that."""
    config = preset_config("tiny")
    values = {"gradient_checkpointing": ckpt, "keep_attention_outputs": keep}
    plan = resolve_plan(TrainConfig(**values), ModelShape.from_config(config), CPU)
    trainer_side = plan.model_setup(None, 1, levers=False)
    own_loop = ParallelizeConfig(attn_implementation="sdpa", **values).resolve(config)
    assert trainer_side.attention_stash is own_loop.attention_stash is stash
    from ulysses_trainer import make_parallel_state
    from ulysses_trainer.model.load import build_model

    model = parallelize(build_model(config, torch.float32), make_parallel_state(1), trainer_side)
    assert (model.attention.stash is not None) is stash


# ------------------------------------------------------------------------------------------------
# No raw lever field is read outside the decoder


def _config_holder(node: ast.expr, in_config_class: bool) -> bool:
    """Whether `node` names a TrainConfig or ParallelizeConfig: `cfg`, `config`, `<x>.cfg`, or `self` inside
    a *Config class (the package's names for them; a Plan, Settings or Levers is `plan`, `s`, `fx`...)."""
    if isinstance(node, ast.Name):
        return node.id in {"cfg", "config", "train_config"} or (node.id == "self" and in_config_class)
    return isinstance(node, ast.Attribute) and node.attr == "cfg"


def raw_lever_reads(source: str) -> list[tuple[int, str]]:
    """(line, field) of every read of a raw lever field of a config in `source`."""
    out: list[tuple[int, str]] = []

    def walk(node: ast.AST, in_config_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = child.name.endswith("Config") if isinstance(child, ast.ClassDef) else in_config_class
            if isinstance(child, ast.Attribute) and child.attr in RAW_LEVERS and isinstance(child.ctx, ast.Load) \
                    and _config_holder(child.value, in_config_class):
                out.append((child.lineno, child.attr))
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id == "getattr" \
                    and len(child.args) > 1 and isinstance(child.args[1], ast.Constant) \
                    and child.args[1].value in RAW_LEVERS:
                out.append((child.lineno, child.args[1].value))
            walk(child, inside)

    walk(ast.parse(source), False)
    return out


def test_the_walker_finds_raw_reads():
    snippet = ("def f(cfg, plan):\n    a = cfg.tiled_mlp\n    b = plan.cfg.activation_offload\n"
               "    c = getattr(x, 'checkpoint_every')\n    d = plan.tiled_mlp\n"
               "class ParallelizeConfig:\n    def g(self):\n        return self.keep_attention_outputs\n")
    assert raw_lever_reads(snippet) == [(2, "tiled_mlp"), (3, "activation_offload"), (4, "checkpoint_every"),
                                        (8, "keep_attention_outputs")]
    assert {f for _, f in raw_lever_reads(DECODER.read_text())} == RAW_LEVERS  # the decoder reads them all


def test_no_raw_lever_field_is_read_outside_the_decoder():
    found = {f"{p.relative_to(PACKAGE.parent)}:{line} {field}"
             for p in sorted(PACKAGE.rglob("*.py")) if p != DECODER and p not in DEFINITION
             for line, field in raw_lever_reads(p.read_text())}
    assert not found, f"decode the levers with vocabulary/lever_settings.decode_levers instead: {sorted(found)}"


@pytest.mark.parametrize("values, installed", [  # installed on the 2-layer tiny model: tiles, offloaded, kept
    ({"tiled_mlp": 2, "checkpoint_every": 2, "activation_offload": 1, "keep_attention_outputs": 1}, (2, (0,), (0,))),
    ({"activation_offload": True, "keep_attention_outputs": True, "tiled_mlp": False}, (1, (0, 1), (0, 1))),
    ({"gradient_checkpointing": False, "tiled_mlp": 3}, (3, (), ())),
])
def test_the_trainers_plan_and_a_loop_of_your_own_install_the_same_levers(values, installed):
    """Fixed levers become the same ModelSetup by both roads (Plan.model_setup, ParallelizeConfig.resolve): one
    lever record, one rule for the layers each covers (ModelSetup.of)."""
    config = preset_config("tiny")
    trainer_side = resolve_plan(TrainConfig(**values), ModelShape.from_config(config), CPU).model_setup(None, 1)
    own_loop = ParallelizeConfig(attn_implementation="sdpa", **values).resolve(config)
    installs = lambda p: (p.levers.tiled_mlp, p.levers.gradient_checkpointing, p.checkpoint_every,  # noqa: E731
                          p.offload_layers, p.kept_attention_layers, p.attention_stash)
    assert installs(trainer_side) == installs(own_loop)
    assert (own_loop.levers.tiled_mlp, own_loop.offload_layers, own_loop.kept_attention_layers) == installed


LEVER_NAMES = {"gradient_checkpointing", *RAW_LEVERS}
# the records that may declare a lever field, and why each holds its own: everything else reads a Levers
LEVER_HOLDERS = {
    "config/train_config.py TrainConfig",  # the user's values as written (decode_levers reads them)
    "vocabulary/lever_settings.py Levers",  # the one record
    "plan/types.py ZeroSettings",  # the ZeRO JSON's own optimizer placement (None: the JSON has no section)
}


def test_no_other_record_copies_a_lever_field():
    # the comm model's Job and the MLP terms' MlpRun hold the plan's Levers; a new record copying tiled_mlp & co.
    # beside it fails here
    holders = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id in LEVER_NAMES
                    for n in node.body):
                holders.add(f"{path.relative_to(PACKAGE).as_posix()} {node.name}")
    assert holders == LEVER_HOLDERS


def test_the_mlp_terms_and_the_comm_jobs_read_the_plans_lever_record():
    from dataclasses import replace

    from ulysses_trainer.plan.collectives import Job
    from ulysses_trainer.plan.inputs import Settings, mlp_run

    shape = ModelShape.preset("qwen3-8b")
    s = Settings(max_length=65_536, layout=Layout(2, 2)).with_levers(checkpoint_every=3, tiled_mlp=8,
                                                                     activation_offload=2)
    run, job = mlp_run(shape, s), Job.of(s)
    assert run.levers == job.levers == s.levers
    assert (run.levers.tiled_mlp, run.levers.gradient_checkpointing, job.levers.checkpoint_every) == (8, True, 3)
    # the terms follow the record: untiled, the MLP keeps its intermediates; tiled, one tile's at most
    untiled = mlp_run(shape, s.with_levers(tiled_mlp=1))
    assert shape.family.mlp.saved(shape.dims, untiled) != shape.family.mlp.saved(shape.dims, run)
    with pytest.raises(ValueError, match="tiles are a plan's count"):
        replace(run, levers=replace(run.levers, tiled_mlp=TRUE_TILES))


def test_the_planners_settings_hold_one_decided_lever_record():
    from dataclasses import fields, replace

    from ulysses_trainer.plan.calibration import settings_from_dict
    from ulysses_trainer.plan.inputs import Settings
    from ulysses_trainer.vocabulary.lever_settings import EVERY_LAYER, LEVER_FIELDS

    assert not {f.name for f in fields(Settings)} & set(LEVER_FIELDS)  # the record, not copies of its fields
    s = Settings(max_length=4096).with_levers(tiled_mlp=4, activation_offload=2)
    assert s.levers == replace(EVERY_LAYER, tiled_mlp=4, activation_offload=2)
    for undecided in ({"tiled_mlp": TRUE_TILES}, {"tiled_mlp": None}, {"activation_offload": "all"},
                      {"checkpoint_every": None}, {"optimizer_offload": None}, {"keep_attention_outputs": "all"}):
        with pytest.raises(ValueError, match="decided lever record"):
            s.with_levers(**undecided)
    # the flat form (plan --json's settings, a calibration point) names each lever once, and reads back
    flat = s.flat()
    assert "levers" not in flat
    assert {n: flat[n] for n in LEVER_FIELDS} == {n: getattr(s.levers, n) for n in LEVER_FIELDS}
    assert settings_from_dict({k: v for k, v in flat.items() if k != "zero3"} | {"zero3": s.zero3.__dict__}) == s
