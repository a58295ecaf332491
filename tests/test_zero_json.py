"""The ZeRO JSON read as DeepSpeed reads it, and refused the same way by `plan` and by the trainer: the same files
through `ulysses-trainer plan` and the trainer's entry point (cli/train.main, what launch/train.py runs) give exit 2
and the same one-line message."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from ulysses_trainer.cli.plan import main as plan_main
from ulysses_trainer.cli.train import main as train_main
from ulysses_trainer.config import REPO_ROOT
from ulysses_trainer.ds_config import load_ds_config
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.plan.inputs import Settings
from ulysses_trainer.plan.types import read_zero
from ulysses_trainer.vocabulary.layout import Layout
from ulysses_trainer.zero_json import DEEPSPEED_TOP_LEVEL, DEEPSPEED_ZERO_DEFAULTS

ZERO3 = json.loads((REPO_ROOT / "ds_configs" / "zero3.json").read_text())


def _with(path: Path, edit) -> str:
    ds = json.loads(json.dumps(ZERO3))
    edit(ds)
    path.write_text(json.dumps(ds, indent=1))
    return str(path)


def _zero(**kw):
    return lambda ds: ds["zero_optimization"].update(kw)


def _top(**kw):
    return lambda ds: ds.update(kw)


# name: (edit of the shipped zero3.json, extra command-line settings, pattern of the one error line)
CASES = {
    "fp16_on": (_top(fp16={"enabled": True}), [], r"fp16\.enabled is true in .*; fp16 is not supported"),
    "micro_batch_conflict": (_top(train_micro_batch_size_per_gpu=2), [],
                             r"train_micro_batch_size_per_gpu is 2 in .* but the training config gives "
                             r"per_device_train_batch_size = 1 \(from the default\); set it to \"auto\" in the JSON "
                             r"or set per_device_train_batch_size 2 in the recipe or on the command line"),
    "clipping_conflict_from_the_command_line": (
        _top(gradient_clipping=0.5), ["--max_grad_norm", "0.7"],
        r"gradient_clipping is 0\.5 in .* max_grad_norm = 0\.7 \(from the command line\); set it to \"auto\" in the "
        r"JSON or pass --max_grad_norm 0\.5 on the command line"),
    "auto_where_nothing_fills_it": (_zero(stage3_max_live_parameters="auto"), [],
                                    r"has \"auto\" at zero_optimization\.stage3_max_live_parameters, which this "
                                    r"trainer does not fill; write a value there"),
    "misspelt_zero_key_holding_auto": (
        lambda ds: ds["zero_optimization"].update({"stage3_prefetch_bucket_sise":
                                                   ds["zero_optimization"].pop("stage3_prefetch_bucket_size")}),
        [], r"unknown key 'zero_optimization\.stage3_prefetch_bucket_sise' in ZeRO config .*: did you mean "
            r"'stage3_prefetch_bucket_size'\?"),
    "misspelt_top_level_key": (_top(gradient_cliping=1.0), [],
                               r"unknown key 'gradient_cliping' in ZeRO config .*: did you mean 'gradient_clipping'\? "
                               r"\(DeepSpeed ignores a key it does not know, so it would silently do nothing\)"),
    "unknown_top_level_key": (_top(my_notes="x"), [], r"unknown key 'my_notes' in ZeRO config .*: remove it"),
    "deepspeed_activation_checkpointing": (
        _top(activation_checkpointing={"partition_activations": True, "cpu_checkpointing": True}), [],
        r"activation_checkpointing \(cpu_checkpointing, partition_activations\) in .* would do nothing\. .*"
        r"activation_offload"),
    "parameter_offload": (_zero(offload_param={"device": "cpu"}), [],
                          r"zero_optimization\.offload_param \(device \"cpu\"\) in .*: the plan does not model "
                          r"ZeRO-Infinity parameter offload .* optimizer_offload"),
}


def _plan(argv: list[str], capsys) -> tuple[int, list[str]]:
    rc = plan_main(["--gpu_memory_gb", "80", "--host_memory_gb", "100", *argv])
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def _train(argv: list[str], out: Path, monkeypatch, capsys) -> tuple[int, list[str]]:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    rc = train_main([*argv, "--output_dir", str(out)])
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("name", list(CASES))
def test_plan_and_the_trainer_refuse_the_same_json_with_the_same_message(name, tmp_path, monkeypatch, capsys):
    edit, extra, pattern = CASES[name]
    path = _with(tmp_path / f"{name}.json", edit)
    rc_plan, plan_errors = _plan(["--max_length", "64", "--deepspeed", path, *extra], capsys)
    rc_train, train_errors = _train(["--max_length", "64", "--deepspeed", path, *extra], tmp_path / "out",
                                    monkeypatch, capsys)
    assert (rc_plan, rc_train) == (2, 2), (plan_errors, train_errors)
    assert len(plan_errors) == 1 and re.search(pattern, plan_errors[0]), plan_errors
    assert train_errors == plan_errors
    assert not (tmp_path / "out").exists()


def test_the_shipped_json_still_fits_in_plan(tmp_path, capsys):
    rc, errors = _plan(["--max_length", "64", "--deepspeed", str(REPO_ROOT / "ds_configs" / "zero3.json")], capsys)
    assert rc == 0 and not errors


def test_conflict_names_the_recipe_it_came_from(tmp_path, capsys):
    path = _with(tmp_path / "clip.json", _top(gradient_clipping=0.5))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"max_length: 64\nmax_grad_norm: 0.25\ndeepspeed: {path}\n")
    rc, errors = _plan(["--config", str(recipe)], capsys)
    assert rc == 2
    assert re.search(rf"max_grad_norm = 0\.25 \(from recipe {re.escape(str(recipe))}\); set it to \"auto\" in the "
                     rf"JSON or set max_grad_norm 0\.5 in recipe {re.escape(str(recipe))}", errors[0]), errors


def test_a_zero_json_passed_as_the_recipe_says_to_pass_it_with_deepspeed(capsys):
    shipped = str(REPO_ROOT / "ds_configs" / "zero3.json")
    rc, errors = _plan(["--config", shipped], capsys)
    assert rc == 2
    assert re.search(rf"{re.escape(shipped)} is a ZeRO \(DeepSpeed\) JSON, not a training recipe: pass it with "
                     rf"--deepspeed {re.escape(shipped)}", errors[0]), errors
    rc, errors = _plan(["--max_length", "64", "--train_batch_size", "8"], capsys)
    assert rc == 2 and "it is a key of the ZeRO (DeepSpeed) JSON, not a training setting" in errors[0], errors


# ---------------------------------------------------------------- the reader: what DeepSpeed reads
def _deepspeed_reads(path: Path) -> dict:
    """DeepSpeed's own loading of a config file (DeepSpeedConfig(path)._param_dict)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig(str(path))._param_dict


def test_comments_and_trailing_commas_are_read_as_deepspeed_reads_them(tmp_path):
    p = tmp_path / "commented.json"
    p.write_text('{\n  // one sequence per rank\n  "train_micro_batch_size_per_gpu": 1,\n'
                 '  "gradient_accumulation_steps": 1,\n  "train_batch_size": 1, # no mpu: every rank counts\n'
                 '  /* ZeRO-3 */\n  "zero_optimization": {"stage": 3, "reduce_bucket_size": 1e6,},\n}\n')
    ours = load_ds_config(str(p))
    assert ours == _deepspeed_reads(p)
    assert ours["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 1_000_000}


def test_a_duplicated_key_is_refused_as_deepspeed_refuses_it(tmp_path):
    p = tmp_path / "dup.json"
    p.write_text('{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1,\n'
                 ' "zero_optimization": {"stage": 3, "reduce_bucket_size": 1, "reduce_bucket_size": 2}}')
    with pytest.raises(ValueError, match="Duplicate keys in DeepSpeed config"):
        _deepspeed_reads(p)
    with pytest.raises(ConfigError, match=r"dup\.json writes 'reduce_bucket_size' twice in one object; DeepSpeed "
                                          r"refuses duplicate keys"):
        load_ds_config(str(p))


def test_a_syntax_error_names_the_line_and_column(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{\n  "zero_optimization": {"stage": }\n}\n')
    with pytest.raises(ConfigError, match=r"bad\.json is not valid at line 2, column 34: .*fix the syntax there"):
        load_ds_config(str(p))


def test_every_key_deepspeed_looks_up_is_known():
    """DeepSpeedConfig's lookups of the top-level keys, recorded: a key DeepSpeed reads is never refused as unknown."""
    from deepspeed.runtime.config import DeepSpeedConfig

    seen: set[str] = set()

    class Recording(dict):
        def get(self, key, *default):
            seen.add(key)
            return super().get(key, *default)

        def __getitem__(self, key):
            seen.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            seen.add(key)
            return super().__contains__(key)

    DeepSpeedConfig(Recording({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                               "zero_optimization": {"stage": 3}}))
    assert len(seen) > 30
    assert seen <= DEEPSPEED_TOP_LEVEL, sorted(seen - DEEPSPEED_TOP_LEVEL)


def test_sizes_left_out_are_deepspeeds_defaults_and_either_spelling_is_read():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    model = DeepSpeedZeroConfig()
    fields = {"reduce_bucket_size": "reduce_bucket_size", "stage3_prefetch_bucket_size": "prefetch_bucket_size",
              "stage3_param_persistence_threshold": "param_persistence_threshold",
              "stage3_max_live_parameters": "max_live_parameters", "stage3_max_reuse_distance": "max_reuse_distance",
              "sub_group_size": "sub_group_size"}
    assert DEEPSPEED_ZERO_DEFAULTS == {k: getattr(model, f) for k, f in fields.items()}
    bare = read_zero({"zero_optimization": {"stage": 3}}).knobs  # what DeepSpeed runs, not the "auto" fill
    assert (bare.reduce_bucket_size, bare.prefetch_bucket_size, bare.param_persistence_threshold,
            bare.max_reuse_distance) == (500_000_000, 50_000_000, 100_000, 1_000_000_000)
    auto = read_zero(ZERO3).knobs
    assert (auto.reduce_bucket_size, auto.prefetch_bucket_size, auto.param_persistence_threshold) == (None,) * 3
    named = read_zero({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 7, "max_reuse_distance": 9}}).knobs
    assert (named.prefetch_bucket_size, named.max_reuse_distance) == (7, 9)
    with pytest.raises(ConfigError, match="has both 'stage3_prefetch_bucket_size' and 'prefetch_bucket_size'"):
        load_ds_config({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 2}})


def test_the_rehearsal_times_communication_with_the_plans_sizes():
    """comm_job (the rehearsal) and the plan's step time build their comm-model job from the same reader."""
    from types import SimpleNamespace

    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.train.rehearsal import comm_job

    zero = read_zero({"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 12345,
                                            "reduce_bucket_size": "auto"}})
    run = Settings(max_length=64, layout=Layout(2, 2), bf16=False, zero3=zero.by_placement[False])
    plan = SimpleNamespace(cfg=TrainConfig(), resolved=SimpleNamespace(run=run))
    job = comm_job(plan, gpus_per_node=8, levers=run.levers)
    assert comm_job(plan, gpus_per_node=8, levers=replace(run.levers, tiled_mlp=7)).levers.tiled_mlp == 7
    assert (job.max_reuse_distance, job.reduce_bucket_size, job.param_persistence_threshold) == (12345, None, 100_000)


def test_an_all_off_activation_checkpointing_section_and_offload_to_none_are_accepted():
    ds = load_ds_config({**ZERO3, "activation_checkpointing": {"partition_activations": False},
                         "zero_optimization": {**ZERO3["zero_optimization"], "offload_param": {"device": "none"}}})
    assert ds["activation_checkpointing"] == {"partition_activations": False}
