"""The parameters' copy back from the optimizer's fp32 masters through a staging buffer (levers/copy_back.py), in a
real DeepSpeed ZeRO-3 engine on CPU (bf16, several sub-groups): every sub-group goes through the buffers, which are
page-locked where CUDA is, and after two steps every parameter is bitwise the one DeepSpeed's own copy gives."""

from __future__ import annotations

import pytest

from tests.dist_utils import run_ranks, zero3_config

pytestmark = pytest.mark.slow


def _two_steps(rank: int, world_size: int, staged: bool):
    import deepspeed
    import torch

    from tests.test_sp_exact import build_model, make_batch
    from ulysses_trainer.levers.copy_back import PinnedCopyBack

    model = build_model(2).to(torch.bfloat16)
    start = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    cfg = zero3_config(world_size, sub_group_size=20_000)
    cfg["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    opt = engine.optimizer
    copier = PinnedCopyBack.install(opt, always=True) if staged else None
    groups = len(opt.fp16_groups)
    ids, pos = make_batch(1, 24)
    for _ in range(2):
        loss = engine(input_ids=ids, position_ids=pos, labels=ids).loss
        engine.backward(loss)
        engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    pinned = copier is not None and all(b.is_pinned() for b in copier.buffers)
    moved = sum(not torch.equal(params[n], start[n]) for n in params)
    return params, groups, copier.staged if copier else 0, pinned, moved


def test_staged_copy_back_is_bitwise_deepspeeds():
    import torch

    (ref, groups, _, _, _), = run_ranks(1, _two_steps, False)
    (got, groups_again, staged, pinned, moved), = run_ranks(1, _two_steps, True)
    assert groups == groups_again and groups > 1  # several sub-groups: the buffers alternate
    assert staged == 2 * groups
    assert pinned == torch.cuda.is_available()
    assert moved == len(got)  # the steps changed every parameter: the copies carried real updates
    for name, p in ref.items():
        assert torch.equal(got[name], p), name


@pytest.mark.parametrize("version, installs", [("0.19.8", True), ("0.19.0", True), ("0.20.0", False),
                                               ("0.17.6", False)])
def test_installs_only_on_the_deepspeed_release_it_was_checked_against(monkeypatch, version, installs):
    """It replaces a private method of DeepSpeed's ZeRO-3 optimizer: on another release DeepSpeed's own copy stays."""
    import types

    import deepspeed
    import torch

    from ulysses_trainer.levers.copy_back import PinnedCopyBack

    monkeypatch.setattr(deepspeed, "__version__", version)
    flat = torch.zeros(8, dtype=torch.bfloat16)
    opt = types.SimpleNamespace(fp16_groups=[[flat]], fp16_partitioned_groups_flat=[flat],
                                fp32_partitioned_groups_flat=[torch.zeros(8)],
                                _reassign_or_swap_out_partitioned_parameters=lambda i: None,
                                _unflatten_partitioned_parameters=lambda i: None)
    assert (PinnedCopyBack.install(opt, always=True, pin=False) is not None) == installs
