"""The benchmark scripts run on CPU with the tiny preset, and every case of benchmarks/suite.py calls them with
flags they accept, so a GPU machine never meets a broken script."""

import contextlib
import json
import re
import socket
from pathlib import Path

import pytest
import torch
from transformers import Qwen3ForCausalLM

from benchmarks import suite
from tests.dist_utils import JOB_TIMEOUT_S
from tests.warm_ranks import run_script
from ulysses_trainer.families.presets import preset_config

ROOT = Path(__file__).resolve().parent.parent


def _trainer_names() -> set[str]:
    from dataclasses import fields

    from ulysses_trainer.config import TrainConfig

    return {f"--{f.name}" for f in fields(TrainConfig)} | {"--config"}


def test_every_suite_case_calls_an_existing_script_with_flags_it_defines(tmp_path):
    from ulysses_trainer.cli.rehearse import _OWN

    trainer = _trainer_names()
    for case in suite.CASES:
        for _, *argv in suite.commands(case, str(tmp_path)):
            if argv[:2] == ["-m", "deepspeed.launcher.runner"]:  # the launcher's own flags, then the script
                argv = argv[next(i for i, a in enumerate(argv) if a.endswith(".py")):]
            if argv[0] in ("benchmarks/profile_rehearsal.py", "benchmarks/packed_epoch.py"):  # theirs, `--`, the run's
                wrapped = argv[argv.index("--") + 1:]
                assert {a for a in wrapped if a.startswith("--")} <= trainer | {f"--{n}" for n in _OWN}, wrapped
                argv = argv[:argv.index("--")]
            used = {a for a in argv if a.startswith("--")}
            if argv[:2] == ["-m", "pytest"]:
                assert (ROOT / argv[-1]).is_file(), (case, argv)
                continue
            if argv[:3] == ["-m", "ulysses_trainer", "rehearse"]:
                defined = trainer | {f"--{n}" for n in _OWN}
            elif argv[0] in ("launch/train.py", "benchmarks/profile_train.py"):  # the trainer's names (+ --out)
                defined = trainer | {"--out"}
            else:
                source = (ROOT / argv[0]).read_text()
                defined = set(re.findall(r'add_argument\(\s*"(--[a-z0-9_-]+)"', source))
            assert used <= defined, (case, argv[0], used - defined)
            for flag in ("--out", "--output_dir"):
                if flag in argv:
                    assert argv[argv.index(flag) + 1].startswith(str(tmp_path)), (case, argv)


def test_suite_refuses_an_unknown_case(capsys):
    assert suite.main(["kernels", "no_such_case"]) == 2
    assert "error: unknown case no_such_case" in capsys.readouterr().err



@pytest.mark.slow
def test_long_context_standin_probe_with_the_new_levers_holds_adam_states(tmp_path):
    out = tmp_path / "probe.json"
    args = ["--system", "ours", "--model", "tiny", "--lengths", "256", "--steps", "1", "--standin-from", "1",
            "--checkpoint-every", "2", "--offload-optimizer", "--keep-attention-outputs", "true", "--out", str(out)]
    # `python benchmarks/long_context.py ARGS`, forked from the preloaded server (tests/warm_ranks.py)
    res = run_script(1, "benchmarks/long_context.py", args, timeout=JOB_TIMEOUT_S, launched=False)
    assert res.returncode == 0, res.stderr[-3000:]
    (point,) = json.loads(out.read_text())["points"]
    assert point["status"] == "ok", point
    with torch.device("meta"):
        n = sum(p.numel() for p in Qwen3ForCausalLM(preset_config("tiny")).parameters())
    # AdamW's m and v exist (fp32, 8 bytes per parameter) whether or not DeepSpeed takes the update
    assert point["adam_states"] == 8 * n and point["first_step"] is False
    assert (point["checkpoint_every"], point["offload_optimizer"], point["lean_norm"]) == (2, True, True)
    assert point["keep_attention_outputs"] is True and point["grouped_attention"] is True


@pytest.mark.slow
def test_profile_step_buckets_attention_and_matmuls(tmp_path):
    out = tmp_path / "profile.json"
    args = ["--model", "tiny", "--length", "128", "--keep-attention-outputs", "true", "--norm-kernel", "torch",
            "--rope", "torch", "--out", str(out)]
    with contextlib.ExitStack() as held:  # the port the benchmarks once all used, held as another job would
        with contextlib.suppress(OSError):
            sock = held.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 29511))
            sock.listen()
        # `python benchmarks/profile_step.py ARGS` (no MASTER_PORT: it picks a free one), forked as above
        res = run_script(1, "benchmarks/profile_step.py", args, timeout=JOB_TIMEOUT_S, launched=False)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())["seconds_by_bucket"]
    for name in ("attention forward", "attention backward", "matmul"):
        assert got.get(name, 0) > 0, got


def test_profile_rehearsal_buckets_a_rehearsed_step(tmp_path):
    """benchmarks/profile_rehearsal.py on CPU: the tiny recipe's rank 3 of 4 (at 1,024 tokens), the last of 3 steps
    under the profiler (its kernels in buckets), the rehearsal's own result inside; --no_profile profiles nothing."""
    from benchmarks import profile_rehearsal

    args = ["--", "--config", "launch/recipes/cpu_default.yaml", "--gpus", "4", "--rank", "3", "--steps", "3",
            "--max_length", "1024"]  # 256 tokens a rank: the vocabulary's loss is most of a CPU step
    out = tmp_path / "p.json"
    assert profile_rehearsal.main(["--out", str(out), "--top", "5", *args]) == 0
    got = json.loads(out.read_text())
    assert len(got["step_s"]) == 3 and got["profiled_step"] == 3 and len(got["top"]) == 5
    assert got["seconds_by_bucket"]["matmul"] > 0 and got["total_s"] > 0
    assert got["rehearsal"]["rank"] == 3 and got["rehearsal"]["collective_fill"] == "local"
    assert not (tmp_path / "p.json.rehearsal.json").exists()
    assert profile_rehearsal.main(["--out", str(out), "--no_profile", *args]) == 0
    got = json.loads(out.read_text())
    assert "seconds_by_bucket" not in got and got["top"] == []


def test_cpu_adam_benchmark_writes_the_table_the_planner_reads(tmp_path, monkeypatch):
    """benchmarks/cpu_adam.py times one optimizer step per core count over the offload sub-groups, and its file is
    what plan/rates.cpu_adam_rates_from_results rebuilds a card's CPU Adam table from (torch's AdamW stands in for
    DeepSpeed's compiled one here: the op is not what is checked)."""
    import deepspeed.ops.adam

    from benchmarks import cpu_adam
    from ulysses_trainer.plan import rates

    class AdamW(torch.optim.AdamW):
        def __init__(self, params, lr, weight_decay, adamw_mode):
            assert adamw_mode
            super().__init__(params, lr=lr, weight_decay=weight_decay)

    monkeypatch.setattr(deepspeed.ops.adam, "DeepSpeedCPUAdam", AdamW)
    monkeypatch.setattr(cpu_adam, "SUB_GROUP", 700)
    assert cpu_adam.groups(1500, 700) == [700, 700, 100]
    out = tmp_path / "cpu_adam.json"
    assert cpu_adam.main(["--out", str(out), "--params", "1500", "--cores", "1,2,999", "--iters", "2"]) == 0
    data = json.loads(out.read_text())
    here = data["host_cores"]
    assert [r["cores"] for r in data["rows"]] == [c for c in (1, 2) if c <= here]  # past the host's: left out
    assert all(r["sub_groups"] == 3 and len(r["step_s"]) == 2 and r["s_per_param"] > 0 for r in data["rows"])
    table = rates.cpu_adam_rates_from_results(tmp_path, "cpu_adam.json")
    assert [c for c, _ in table] == [r["cores"] for r in data["rows"]]
