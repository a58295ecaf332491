"""Bring your own loop: examples/own_loop.py on CPU ranks as the launcher starts them, the public ZeRO JSON
filler, and the copies of the example in README.md and docs/library-api.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.dist_utils import JOB_TIMEOUT_S, job_failure
from tests.warm_ranks import run_script
from ulysses_trainer import destroy_distributed, fill_zero_config
from ulysses_trainer.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "own_loop.py"


def run_example(num_gpus: int, args: list[str]) -> list[float]:
    """The losses rank 0 prints, from the ranks of `deepspeed --num_gpus N examples/own_loop.py ...` (forks of
    tests/warm_ranks.py's server; the README's commands launch the example through `deepspeed` itself)."""
    proc = run_script(num_gpus, str(EXAMPLE.relative_to(ROOT)), args, timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, job_failure(proc)
    return [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", proc.stdout, flags=re.M)]


@pytest.mark.slow
def test_example_sp2_on_two_ranks_equals_one_rank_and_learns(tmp_path):
    sp2 = run_example(2, ["--sp_size", "2", "--steps", "3", "--save_dir", str(tmp_path / "sp2")])
    sp1 = run_example(1, ["--steps", "3"])
    assert len(sp2) == len(sp1) == 3
    for a, b in zip(sp2, sp1):
        assert abs(a - b) / b <= 1e-5, (sp2, sp1)
    assert sp2[-1] < sp2[0] - 0.1, sp2  # AdamW at 1e-3 moves the random model off uniform (ln V = 11.93)
    # the trained weights, saved by the engine with the stock keys: a stock model loads them, nothing missing
    import torch

    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.model.load import build_model

    state = torch.load(tmp_path / "sp2" / "pytorch_model.bin")
    assert not any(k.startswith("causal_lm.") for k in state)
    stock = build_model(preset_config("tiny"), torch.float32, seed=0)
    untrained = {k: v.clone() for k, v in stock.state_dict().items()}
    result = stock.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert not torch.equal(stock.state_dict()["model.layers.0.mlp.up_proj.weight"],
                           untrained["model.layers.0.mlp.up_proj.weight"])  # trained weights, not the initial ones


def test_fill_zero_config_fills_every_auto_of_the_shipped_json():
    ds = fill_zero_config("ds_configs/zero3.json", world_size=4, dp_size=2, micro_batch=2, grad_accum=3, lr=3e-4,
                          bf16=True, max_grad_norm=0.5, hidden_size=64)
    assert "auto" not in str(ds)
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 2 * 3 * 4  # DeepSpeed counts every rank as data-parallel
    assert ds["bf16"] == {"enabled": True} and ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    assert "optimizer" not in ds  # the caller passes its own


def test_fill_zero_config_keeps_the_optimizer_for_deepspeed_when_asked():
    ds = fill_zero_config(ROOT / "ds_configs" / "zero3_offload.json", world_size=2, dp_size=2, lr=2e-5,
                          betas=(0.9, 0.95), weight_decay=0.1, deepspeed_optimizer=True)
    assert ds["optimizer"]["params"] == {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    own = fill_zero_config(ROOT / "ds_configs" / "zero3_offload.json", world_size=2, dp_size=2)
    assert "optimizer" not in own and own["zero_force_ds_cpu_optimizer"] is False  # a client optimizer offloaded


def test_fill_zero_config_refuses_conflicts_and_unfilled_autos():
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu is 4 .* set it to \"auto\""):
        fill_zero_config({"train_micro_batch_size_per_gpu": 4}, world_size=1, dp_size=1, micro_batch=1)
    z3 = {"zero_optimization": {"stage": 3}}
    sched = {**z3, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}
    with pytest.raises(ConfigError, match="scheduler.params.warmup_num_steps"):
        fill_zero_config(sched, world_size=1, dp_size=1)
    kept = {**z3, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}
    assert fill_zero_config(kept, world_size=1, dp_size=1)["scheduler"] == kept["scheduler"]


def test_destroy_distributed_without_a_process_group_is_a_no_op():
    destroy_distributed()
    destroy_distributed(together=False)


def test_the_loop_without_an_engine_is_the_tested_one():
    """docs/library-api.md's block 'Without a DeepSpeed engine' is the code tests/test_library_api.py runs."""
    section = (ROOT / "docs" / "library-api.md").read_text().split("## Without a DeepSpeed engine", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    source = (ROOT / "tests" / "test_library_api.py").read_text().splitlines()
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) >= 7 and all(line in source for line in lines), [x for x in lines if x not in source]


@pytest.mark.parametrize("page, heading", [("README.md", "## Bring your own loop"),
                                           ("docs/library-api.md", "## The loop")])
def test_docs_show_the_example_verbatim(page, heading):
    """Every line of the code block under the page's own-loop heading is a line of examples/own_loop.py."""
    text = (ROOT / page).read_text()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    source = EXAMPLE.read_text().splitlines()
    lines = [line for line in block.splitlines() if line.strip() and line.strip() != "..."]
    assert len(lines) >= 20
    missing = [line for line in lines if line not in source]
    assert not missing, missing
