"""One plan per job: the ranks' probes are reduced before the plan and its digest is compared before step 1.

The test seam (docs/testing.md): a rank's probes are the functions of `ulysses_trainer.probe`; a test
replaces `probe.host_memory` (or `local_gpus`, `installed_kernels`) in one rank to make it see another
machine, and `ulysses_trainer.train.prepare.agree_machine` to take the agreement away.
"""

from __future__ import annotations

import contextlib
import io

import pytest

from tests.dist_utils import run_ranks
from ulysses_trainer.plan.types import Machine
from ulysses_trainer.train.agreement import check_same_plan, combine_machines, plan_digest

LESS_HOST_GB = 7.0  # what rank 1 is made not to see


def test_combined_machine_takes_the_least_memory_and_the_shared_kernels():
    a = Machine(gpus=2, gpu_memory_gb=80.0, host_memory_gb=500.0, kernels=("flash4", "flash", "sdpa"),
                norm_kernels=("triton", "torch"), gpu_name="H100", host_memory_source="detected on this machine",
                gpu_free_after_engine_gb=60.0)
    b = Machine(gpus=2, gpu_memory_gb=77.0, host_memory_gb=400.0, kernels=("sdpa", "flash"),
                norm_kernels=("torch",), gpu_name="H100", host_memory_source="host_memory_gb",
                gpu_free_after_engine_gb=62.5)
    both = combine_machines([a, b])
    assert both.gpu_memory_gb == 77.0 and both.host_memory_gb == 400.0 and both.gpu_free_after_engine_gb == 60.0
    assert both.kernels == ("flash", "sdpa") and both.norm_kernels == ("torch",)
    assert both.host_memory_source == "host_memory_gb"  # the figure the plan uses is b's
    assert combine_machines([b, a]) == replace_kernels(both, ("sdpa", "flash"))  # the first rank's order
    cpu = Machine(gpus=2, gpu_memory_gb=None, host_memory_gb=8.0)
    assert combine_machines([cpu, cpu]).gpu_memory_gb is None


def replace_kernels(m: Machine, kernels: tuple[str, ...]) -> Machine:
    from dataclasses import replace

    return replace(m, kernels=kernels, host_memory_source="host_memory_gb")


def _plan(host_gb: float):
    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.plan.inputs import ModelShape
    from ulysses_trainer.plan.resolve import resolve_plan

    cfg = TrainConfig(max_length=256, bf16=False)
    shape = ModelShape.from_config(preset_config(cfg.model_name_or_path))
    return resolve_plan(cfg, shape, Machine(gpus=1, gpu_memory_gb=None, host_memory_gb=host_gb))


def test_digest_follows_the_plan():
    assert plan_digest(_plan(64.0)) == plan_digest(_plan(64.0))
    assert plan_digest(_plan(64.0)) != plan_digest(_plan(64.0 - LESS_HOST_GB))  # the host budget is in the plan
    assert check_same_plan(_plan(64.0), "here") == plan_digest(_plan(64.0))  # one rank: nothing to compare


STAND_IN_GB = 4.0  # the GPU memory the CPU ranks plan for (probe.local_gpus)
FREE_AFTER_ENGINE_GB = {0: 2.0, 1: 0.1}  # rank 1's GPU is left with too little to keep attention outputs
LEVERS = ("checkpoint_every", "activation_offload", "keep_attention_outputs", "tiled_mlp", "optimizer_offload")


def _train_rank(rank: int, world_size: int, argv: list[str], agree_machine: bool,
                agree_free: bool) -> tuple[int, list[dict], str]:
    """The real command's main on this rank. Both ranks plan for a stand-in GPU of STAND_IN_GB; rank 1 sees
    LESS_HOST_GB less host memory, and each rank's GPU has FREE_AFTER_ENGINE_GB[rank] free once the engine is
    built. agree_machine / agree_free False take away the agreement before the model / after the engine.
    Returns (exit code, the plans this rank checked, its stderr)."""
    import ulysses_trainer.probe as probe
    import ulysses_trainer.train.agreement as agreement
    import ulysses_trainer.train.build as build
    import ulysses_trainer.train.prepare as prepare
    from ulysses_trainer.cli.train import main

    probe.local_gpus = lambda index=0: probe.LocalGpus(world_size, STAND_IN_GB, "a stand-in GPU", False)
    probe.free_gpu_memory_gb = lambda device: FREE_AFTER_ENGINE_GB[rank]
    if rank == 1:
        real = probe.host_memory

        def less_host_memory(given_gb):
            gb, source = real(given_gb)
            return gb - LESS_HOST_GB, source

        probe.host_memory = less_host_memory
    if not agree_machine:
        prepare.agree_machine = lambda machine: machine
    if not agree_free:
        build.agree_free_memory = lambda free_gb: free_gb
    plans: list[dict] = []
    real_digest = agreement.plan_digest

    def recorded(plan):
        plans.append(plan.to_dict())
        return real_digest(plan)

    agreement.plan_digest = recorded
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, plans, err.getvalue()


def _argv(out) -> list[str]:
    return ["--sp_size", "2", "--max_length", "128", "--max_steps", "2", "--bf16", "false", "--seed", "3",
            "--save_strategy", "no", "--logging_steps", "1", "--output_dir", str(out)]


def _trained_steps(out) -> int:
    metrics = out / "metrics.jsonl"
    return sum('"loss"' in row for row in metrics.read_text().splitlines()) if metrics.exists() else 0


@pytest.mark.slow
def test_ranks_seeing_different_machines_run_one_agreed_plan_and_train(tmp_path):
    """Rank 1 sees less host memory, and less free GPU memory once the engine is built than the plan expected:
    both ranks plan from the least of each, re-plan alike after the engine (the kept attention outputs go to
    host memory instead), check the same digests and train."""
    (c0, p0, e0), (c1, p1, e1) = run_ranks(2, _train_rank, _argv(tmp_path / "run"), True, True)
    assert (c0, c1) == (0, 0), e0 + e1
    assert p0 == p1 and len(p0) == 2  # before the model is built and after the engine: the same plans
    before, after = ({k: p[k] for k in LEVERS} for p in p0)
    assert after["keep_attention_outputs"] == 0 < before["keep_attention_outputs"], (before, after)  # re-planned
    assert _trained_steps(tmp_path / "run") == 2


@pytest.mark.slow
def test_without_the_agreement_the_digest_check_fires_before_anything_is_written(tmp_path):
    (c0, p0, e0), (c1, p1, e1) = run_ranks(2, _train_rank, _argv(tmp_path / "run"), False, True)
    assert p0 != p1  # the ranks did resolve different plans
    assert (c0, c1) == (1, 1), e0 + e1
    assert "resolved different plans before the model is built" in e0
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_without_the_post_engine_agreement_the_digest_check_fires_before_step_1(tmp_path):
    (c0, p0, e0), (c1, p1, e1) = run_ranks(2, _train_rank, _argv(tmp_path / "run"), True, False)
    assert p0[0] == p1[0] and p0[1] != p1[1]  # one plan before the model; rank 1 alone re-planned after the engine
    assert (c0, c1) == (1, 1), e0 + e1
    assert "resolved different plans with the free GPU memory measured" in e0
    assert _trained_steps(tmp_path / "run") == 0
