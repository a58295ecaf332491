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


def instrument_w_nvtx(func):  # as DeepSpeed's: a wrapper that keeps the function in its closure, no __wrapped__
    def wrapped_fn(*args, **kwargs):
        return func(*args, **kwargs)
    return wrapped_fn


class _Stage3:
    """An optimizer whose reassign method reads as DeepSpeed 0.19.8's (the code lines install compares)."""

    def __init__(self):
        import torch

        flat = torch.zeros(8, dtype=torch.bfloat16)
        self.fp16_groups, self.fp16_partitioned_groups_flat = [[flat]], [flat]
        self.fp32_partitioned_groups_flat = [torch.zeros(8)]

    @instrument_w_nvtx
    def _reassign_or_swap_out_partitioned_parameters(self, sub_group_id):
        if self.fp16_partitioned_groups_flat[sub_group_id] is not None:
            # a comment, as DeepSpeed's has
            self.fp16_partitioned_groups_flat[sub_group_id].data.copy_(
                self.fp32_partitioned_groups_flat[sub_group_id].data)

            self._unflatten_partitioned_parameters(sub_group_id)
        else:
            self._partitioned_params_swap_out(sub_group_id)

    def _unflatten_partitioned_parameters(self, sub_group_id):
        pass


def _changed(self, sub_group_id):  # a release whose copy back does something else first
    self.fp16_partitioned_groups_flat[sub_group_id].data.zero_()
    self._unflatten_partitioned_parameters(sub_group_id)


def test_installs_only_where_deepspeeds_method_is_the_one_it_replaces(capsys):
    """It replaces a private method of DeepSpeed's ZeRO-3 optimizer: it reads the installed one first, and where
    that differs (or an attribute it reads is gone) one line says so and DeepSpeed's own copy stays."""
    import types

    import deepspeed

    from ulysses_trainer.levers.copy_back import PinnedCopyBack

    def said() -> list[str]:  # the console's lines (tests/conftest.py installs it, as the commands do)
        return capsys.readouterr().out.splitlines()

    said()
    assert PinnedCopyBack.install(_Stage3(), always=True, pin=False) is not None
    assert said() == []
    changed = _Stage3()
    changed._reassign_or_swap_out_partitioned_parameters = types.MethodType(_changed, changed)
    assert PinnedCopyBack.install(changed, always=True, pin=False) is None
    assert said() == [
        "[ulysses_trainer] the parameters' copy back stays DeepSpeed's own (slower, the same bytes): "
        f"DeepSpeed {deepspeed.__version__}'s _reassign_or_swap_out_partitioned_parameters is not the "
        "one the pinned copy was written against (0.19.8's)"]
    assert PinnedCopyBack.install(changed, say=False, always=True, pin=False) is None and said() == []  # a peer rank
    bare = types.SimpleNamespace(**vars(_Stage3()))  # the tensors, without the two methods
    assert PinnedCopyBack.install(bare, always=True, pin=False) is None
    lines = said()
    assert len(lines) == 1 and lines[0].endswith("has no _reassign_or_swap_out_partitioned_parameters, "
                                                 "_unflatten_partitioned_parameters"), lines
    # where nothing would be staged (masters and partitions on one device), no line: there is nothing to fall back from
    assert PinnedCopyBack.install(bare, pin=False) is None and said() == []
