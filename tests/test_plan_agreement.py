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
    from ulysses_trainer.model.presets import preset_config
    from ulysses_trainer.plan.inputs import ModelShape
    from ulysses_trainer.plan.resolve import resolve_plan

    cfg = TrainConfig(max_length=256, bf16=False)
    shape = ModelShape.from_config(preset_config(cfg.model_name_or_path))
    return resolve_plan(cfg, shape, Machine(gpus=1, gpu_memory_gb=None, host_memory_gb=host_gb))


def test_digest_follows_the_plan():
    assert plan_digest(_plan(64.0)) == plan_digest(_plan(64.0))
    assert plan_digest(_plan(64.0)) != plan_digest(_plan(64.0 - LESS_HOST_GB))  # the host budget is in the plan
    assert check_same_plan(_plan(64.0), "here") == plan_digest(_plan(64.0))  # one rank: nothing to compare


def _train_rank(rank: int, world_size: int, argv: list[str], agree: bool) -> tuple[int, list[str], str]:
    """The real command's main on this rank; rank 1 sees LESS_HOST_GB less host memory. Returns (exit code,
    the plan digests this rank checked, its stderr)."""
    import ulysses_trainer.probe as probe
    import ulysses_trainer.train.agreement as agreement
    import ulysses_trainer.train.prepare as prepare
    from ulysses_trainer.cli.train import main

    if rank == 1:
        real = probe.host_memory

        def less_host_memory(given_gb):
            gb, source = real(given_gb)
            return gb - LESS_HOST_GB, source

        probe.host_memory = less_host_memory
    if not agree:
        prepare.agree_machine = lambda machine: machine
    digests: list[str] = []
    real_digest = agreement.plan_digest

    def recorded(plan):
        digests.append(real_digest(plan))
        return digests[-1]

    agreement.plan_digest = recorded
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, digests, err.getvalue()


def _argv(out) -> list[str]:
    return ["--sp_size", "2", "--max_length", "128", "--max_steps", "2", "--bf16", "false", "--seed", "3",
            "--save_strategy", "no", "--logging_steps", "1", "--output_dir", str(out)]


@pytest.mark.slow
def test_a_rank_seeing_less_memory_runs_the_agreed_plan_and_trains(tmp_path):
    (c0, d0, e0), (c1, d1, e1) = run_ranks(2, _train_rank, _argv(tmp_path / "run"), True)
    assert (c0, c1) == (0, 0), e0 + e1
    assert d0 == d1 and len(d0) == 2  # before the model is built and after the engine: the same digests
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert sum('"loss"' in row for row in rows) == 2  # both steps trained


@pytest.mark.slow
def test_without_the_agreement_the_digest_check_fires_before_step_1(tmp_path):
    (c0, d0, e0), (c1, d1, e1) = run_ranks(2, _train_rank, _argv(tmp_path / "run"), False)
    assert d0 != d1  # the ranks did resolve different plans
    assert (c0, c1) == (1, 1), e0 + e1
    assert "resolved different plans before the model is built" in e0
    assert not (tmp_path / "run").exists()  # before anything was written



# ------------------------------------------------------------------ the plan after the engine
STAND_IN_GB = 4.0  # a GPU's memory the CPU ranks plan for (probe.local_gpus)
FREE_AFTER_ENGINE_GB = {0: 2.0, 1: 0.1}  # rank 1's GPU is left with too little to keep attention outputs


def _replan_rank(rank: int, world_size: int, argv: list[str], agree: bool) -> tuple[int, list[dict], str]:
    """The real command's main on this rank, planning for a stand-in GPU whose free memory after the engine is
    FREE_AFTER_ENGINE_GB[rank]. Returns (exit code, the plans this rank checked, its stderr)."""
    import ulysses_trainer.probe as probe
    import ulysses_trainer.train.agreement as agreement
    import ulysses_trainer.train.trainer as trainer
    from ulysses_trainer.cli.train import main

    probe.local_gpus = lambda index=0: probe.LocalGpus(world_size, STAND_IN_GB, "a stand-in GPU", False)
    probe.free_gpu_memory_gb = lambda device: FREE_AFTER_ENGINE_GB[rank]
    if not agree:
        trainer.agree_free_memory = lambda free_gb: free_gb
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


LEVERS = ("checkpoint_every", "activation_offload", "keep_attention_outputs", "tiled_mlp", "optimizer_offload")


@pytest.mark.slow
def test_the_plan_after_the_engine_is_made_from_the_least_free_memory_and_changes_alike(tmp_path):
    """Rank 1's GPU is left with less than the plan expected: both ranks re-plan from its free memory (the
    kept attention outputs go to host memory instead), run that plan, and train."""
    (c0, p0, e0), (c1, p1, e1) = run_ranks(2, _replan_rank, _argv(tmp_path / "run"), True)
    assert (c0, c1) == (0, 0), e0 + e1
    assert p0 == p1 and len(p0) == 2  # before the model is built and after the engine: the same plans
    before, after = ({k: p[k] for k in LEVERS} for p in p0)
    assert before != after, before  # the re-plan changed what the run does
    assert after["keep_attention_outputs"] == 0 < before["keep_attention_outputs"]
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert sum('"loss"' in row for row in rows) == 2


@pytest.mark.slow
def test_without_the_post_engine_agreement_the_digest_check_fires_before_step_1(tmp_path):
    (c0, p0, e0), (c1, p1, e1) = run_ranks(2, _replan_rank, _argv(tmp_path / "run"), False)
    assert p0[0] == p1[0] and p0[1] != p1[1]  # one plan before the model; rank 1 alone re-planned after the engine
    assert (c0, c1) == (1, 1), e0 + e1
    assert "resolved different plans with the free GPU memory measured" in e0
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or '"loss"' not in (
        tmp_path / "run" / "metrics.jsonl").read_text()  # no step ran
