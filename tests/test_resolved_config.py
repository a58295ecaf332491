"""The resolved config is visible: the ZeRO JSON as the engine runs it (every "auto" filled) and one startup line of
what the trainer filled; and `ulysses-trainer plan` on a machine without a GPU plans that machine's CPU run, the
plan the trainer resolves there (so plan = train can be checked anywhere)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ulysses_trainer import probe
from ulysses_trainer.__main__ import main as cli_main
from ulysses_trainer.cli.argv import load_config
from ulysses_trainer.ds_config import fill_ds_config, load_ds_config
from ulysses_trainer.ds_config_record import filled_line, filled_values
from ulysses_trainer.train.prepare import prepare

ROOT = Path(__file__).resolve().parent.parent
ZERO3 = ROOT / "ds_configs" / "zero3.json"


def test_the_filled_values_are_those_the_json_left_to_the_trainer():
    raw = load_ds_config(str(ZERO3))
    cfg = load_config(["--max_length", "64", "--bf16", "false", "--learning_rate", "3e-4"])
    ds, _ = fill_ds_config(raw, cfg, world_size=2, dp_size=1, device_is_cuda=False, bf16=False, hidden_size=64,
                           use_deepspeed_optimizer=False)
    changed, removed = filled_values(raw, ds)
    auto = [k for k, v in _leaves(raw).items() if v == "auto" and not k.startswith("optimizer.")]
    assert sorted(auto) == sorted(k for k in changed if k in auto)  # every "auto" outside the optimizer is said
    assert changed["train_batch_size"] == 2 and changed["bf16.enabled"] is False  # DeepSpeed counts both ranks
    assert changed["zero_optimization.reduce_bucket_size"] == 64 * 64
    assert "stage3_max_live_parameters" not in json.dumps(changed)  # written in the JSON: not the trainer's
    assert removed == ["optimizer"]  # AdamW built by the trainer on CPU
    line = filled_line(raw, ds, "ds_configs/zero3.json")
    assert "\n" not in line and line.startswith("ZeRO config ds_configs/zero3.json, filled: train_batch_size 2, ")
    assert "taken out: optimizer" in line and "ds_config.json in output_dir" in line


def _leaves(obj, prefix=""):
    if isinstance(obj, dict):
        return {p: v for k, v in obj.items() for p, v in _leaves(v, f"{prefix}{k}.").items()}
    return {prefix.rstrip("."): obj}


@pytest.mark.skipif(torch.cuda.is_available(), reason="plans this machine's CPU run: a machine without a GPU")
def test_plan_without_a_gpu_plans_the_cpu_run_the_trainer_resolves(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(probe, "host_memory", lambda given: (given, "host_memory_gb") if given is not None
                        else (16.0, "detected on this machine"))  # one figure for both sides
    argv = ["--max_length", "64", "--bf16", "false"]
    rc = cli_main(["plan", *argv, "--gpus", "2", "--json"])
    out = capsys.readouterr().out
    printed = json.loads(out[out.index("{\n") if not out.startswith("{") else 0:])
    assert rc == 0 and printed["hardware"]["gpu_memory_gb"] is None and printed["largest_max_length"] is None
    run = prepare(load_config([*argv, "--output_dir", str(tmp_path / "out")]), 2, training=False)
    assert run.machine.gpu_memory_gb is None and run.device == "cpu"
    assert printed["plan"] == json.loads(json.dumps(run.resolved.to_dict()))
    assert printed["plan"]["keep_attention_outputs"] in (0, [])  # what the CPU run keeps: none (a GPU plan: 2/2)
    assert "auto" not in json.dumps(run.ds_config)  # and its ZeRO JSON is complete
    text_rc = cli_main(["plan", *argv, "--gpus", "2"])
    text = capsys.readouterr().out
    assert text_rc == 0 and "2 CPU rank(s)" in text and f"fits: {run.resolved.summary()}" in text
