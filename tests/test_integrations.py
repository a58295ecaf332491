"""Third-party patches (parallel/integrations.py) are scoped: each is undone when its block ends or its owner goes;
importing the trainer patches and registers nothing, and imports none of the rehearsal's process groups."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import JOB_TIMEOUT_S
from ulysses_trainer.parallel import integrations

ROOT = Path(__file__).resolve().parent.parent


def _backend_tables() -> dict:
    b = dist.Backend
    return {"list": list(b.backend_list), "plugins": sorted(b._plugins), "types": sorted(b.backend_type_map),
            "capability": {k: list(v) for k, v in b.backend_capability.items()},
            "devices": dict(b.default_device_backend_map), "attrs": sorted(k for k in vars(b) if k.isupper())}


def test_the_shm_op_entry_is_false_within_the_block_only(monkeypatch):
    import deepspeed.ops

    table = {integrations.SHM_OP: True, "cpu_adam": True}  # as DeepSpeed's probe would leave it
    monkeypatch.setattr(deepspeed.ops, "__compatible_ops__", table, raising=False)
    with integrations.without_deepspeed_shm_op():
        assert deepspeed.ops.__compatible_ops__[integrations.SHM_OP] is False
    assert table == {integrations.SHM_OP: True, "cpu_adam": True}
    del table[integrations.SHM_OP]
    with pytest.raises(RuntimeError, match="inside"):
        with integrations.without_deepspeed_shm_op():
            raise RuntimeError("inside")
    assert table == {"cpu_adam": True}  # an entry that was not there is removed again, also after an error


def test_an_attention_entry_lives_as_long_as_its_model():
    owner = torch.nn.Linear(2, 2)
    attend, mask = (lambda *a, **k: None), (lambda *a, **k: None)
    name = integrations.register_attention("ulysses_test_entry", attend, mask, owner=owner)
    assert integrations.attention_registered(name)
    del owner
    gc.collect()
    assert not integrations.attention_registered(name)


def test_parallelize_registers_its_attention_for_the_models_lifetime():
    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.model.load import build_model
    from ulysses_trainer.model.parallelize import ParallelizeConfig, parallelize
    from ulysses_trainer.parallel.state import single_process_state

    config = preset_config("tiny")
    config.num_hidden_layers = 1
    model = parallelize(build_model(config, torch.float32), single_process_state(),
                        ParallelizeConfig(local_seq_len=64, attn_implementation="sdpa"))
    name = model.config._attn_implementation
    assert name.startswith("ulysses_sp1") and integrations.attention_registered(name)
    del model
    gc.collect()
    assert not integrations.attention_registered(name)  # before: one entry per parallelize call, never removed


def test_a_later_entry_of_the_same_name_is_left_alone():
    first, second = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    fn1, fn2, mask = (lambda: 1), (lambda: 2), (lambda: None)
    integrations.register_attention("ulysses_test_same", fn1, mask, owner=first)
    integrations.register_attention("ulysses_test_same", fn2, mask, owner=second)
    del first
    gc.collect()
    assert integrations.attention_registered("ulysses_test_same")
    del second
    gc.collect()
    assert not integrations.attention_registered("ulysses_test_same")


def test_the_backend_is_known_within_the_block_only():
    before = _backend_tables()
    with integrations.process_group_backend("ulysses_test_backend", lambda *a: None, ["cpu", "cuda"]):
        assert "ulysses_test_backend" in dist.Backend.backend_list
        assert "ULYSSES_TEST_BACKEND" in dist.Backend._plugins
    assert _backend_tables() == before


def test_the_rehearsal_group_leaves_torchs_tables_as_they_were():
    from ulysses_trainer.parallel.fake import fake_process_group
    from ulysses_trainer.parallel.local_fill import BACKEND

    before = _backend_tables()
    assert BACKEND not in dist.Backend.backend_list
    with fake_process_group(1, 2, gpus_per_node=8, device="cpu"):
        assert dist.get_backend() == BACKEND
    after = _backend_tables()
    # torch's own fake backend registers itself when its module is first imported (maybe inside the block): allowed
    for tables in (before, after):
        for table in ("list", "plugins", "types", "attrs"):
            tables[table] = [k for k in tables[table] if k.lower() != "fake"]
        tables["capability"].pop("fake", None)
    assert after == before


def test_the_rank0_trace_check_comes_back():
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator

    check = coordinator.assert_ints_same_as_other_ranks
    with integrations.deepspeed_rank0_trace_check_off():
        assert coordinator.assert_ints_same_as_other_ranks is not check
        coordinator.assert_ints_same_as_other_ranks([1, 2])  # no collective, no error
    assert coordinator.assert_ints_same_as_other_ranks is check


def _collective_warnings() -> list[str]:
    """The FutureWarnings torch gives for an all_gather_into_tensor and a reduce_scatter_tensor on a fake group."""
    import warnings

    from ulysses_trainer.parallel.fake import fake_process_group

    with warnings.catch_warnings(record=True) as seen, fake_process_group(0, 2, gpus_per_node=8, device="cpu"):
        warnings.filterwarnings("always", category=FutureWarning, append=True)  # after the filters in force
        dist.all_gather_into_tensor(torch.zeros(4), torch.ones(2))
        dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(4))
        warnings.warn("`torch.distributed.something_else` is deprecated", FutureWarning, stacklevel=1)  # not ours
    return [str(w.message).split(" is ")[0] for w in seen if w.category is FutureWarning]


def test_torchs_notice_on_deepspeeds_collectives_is_quiet_while_the_model_lives(monkeypatch):
    import warnings

    # alone in this process: an engine another test built on this worker may still hold the filter
    monkeypatch.setattr(integrations, "_quiet_owners", [])
    monkeypatch.setattr(warnings, "filters", [f for f in warnings.filters if not (
        f[1] is not None and f[1].pattern == integrations.DEEPSPEED_DEPRECATIONS)])
    other = "`torch.distributed.something_else`"
    names = ["`torch.distributed.all_gather_into_tensor`", "`torch.distributed.reduce_scatter_tensor`"]
    assert _collective_warnings() == [*names, other]  # torch warns (the notice this hides is real)

    class Model:
        pass

    first, second = Model(), Model()
    integrations.quiet_deepspeed_deprecations(first)
    integrations.quiet_deepspeed_deprecations(second)
    try:
        assert _collective_warnings() == [other]
        with warnings.catch_warnings(record=True) as seen:  # the filter itself: those two messages only
            warnings.warn(names[0] + " is deprecated. Please use ...", FutureWarning, stacklevel=1)
            warnings.warn(names[1] + " is deprecated. Please use ...", FutureWarning, stacklevel=1)
            warnings.warn(names[0] + " is deprecated. Please use ...", UserWarning, stacklevel=1)
        assert [w.category for w in seen] == [UserWarning]
        del first
        gc.collect()
        assert _collective_warnings() == [other]  # the second model's engine still runs
    finally:
        del second
        gc.collect()
    assert not integrations._quiet_owners
    assert not any(f[1] is not None and f[1].pattern == integrations.DEEPSPEED_DEPRECATIONS
                   for f in warnings.filters)
    assert _collective_warnings() == [*names, other]


_IMPORT_PROBE = r"""
import json, sys
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

def tables():
    b = dist.Backend
    return [list(b.backend_list), sorted(b._plugins), sorted(b.backend_type_map), sorted(b.backend_capability),
            dict(b.default_device_backend_map), sorted(k for k in vars(b) if k.isupper())]

before = tables(), sorted(AttentionInterface._global_mapping), sorted(AttentionMaskInterface._global_mapping)
import ulysses_trainer.train.trainer  # noqa: E402
import ulysses_trainer.cli.train  # noqa: E402
import ulysses_trainer.cli.rank  # noqa: E402
import deepspeed.ops  # noqa: E402
after = tables(), sorted(AttentionInterface._global_mapping), sorted(AttentionMaskInterface._global_mapping)
print(json.dumps({"same": before == after, "deepspeed": "deepspeed" in sys.modules,
                  "ops_probed": "__compatible_ops__" in vars(deepspeed.ops),
                  # (torch's own fake_pg module is imported by transformers.modeling_utils: not ours to keep out)
                  "rehearsal_modules": sorted(m for m in sys.modules if m.startswith("ulysses_trainer") and
                                              m.endswith(("parallel.fake", "parallel.local_fill", "rehearsal")))}))
"""


@pytest.mark.slow
def test_importing_the_trainer_registers_nothing():
    out = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], cwd=ROOT, capture_output=True, text=True,
                         timeout=JOB_TIMEOUT_S)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["deepspeed"], "the probe must import what a run imports"
    assert seen == {"same": True, "deepspeed": True, "ops_probed": False, "rehearsal_modules": []}
