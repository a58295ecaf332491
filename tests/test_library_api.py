"""The library API as docs/library-api.md gives it, used through the public names only (`ulysses_trainer`):
parallelize leaves the caller's config alone, undoes to the stock model, refuses misuse with one clear error,
gives each rank's logits and final hidden states, gives a stock state dict, and the loop without a DeepSpeed engine
(all-reduce of the gradients of loss_sum / tokens) equals the unsharded reference."""

from __future__ import annotations

import dataclasses
import gc
import re

import pytest
import torch

from tests.test_sp_exact import build_model as build_reference_model
from tests.test_sp_exact import make_batch, reference
from tests.threaded_ranks import run_threads
from ulysses_trainer import (
    ParallelizeConfig,
    ShardContext,
    make_parallel_state,
    parallelize,
    shard_batch,
    stock_state_dict,
    unparallelize,
)
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.families.presets import preset_config
from ulysses_trainer.model.load import build_model

LENGTH = 32


def _config():
    config = preset_config("tiny")
    config.num_hidden_layers = 2
    return config


def _ids(seed: int = 0, length: int = LENGTH) -> torch.Tensor:
    return torch.randint(0, 1000, (1, length), generator=torch.Generator().manual_seed(seed))


def _module_types(model: torch.nn.Module) -> list[tuple[str, type]]:
    return [(n, type(m)) for n, m in model.named_modules()]


def test_the_callers_config_is_never_changed_and_undo_gives_the_stock_model():
    config = _config()
    model = build_model(config, torch.float32, seed=0)  # transformers sets dtype and sdpa on the config here
    before = (config.to_dict(), config._attn_implementation)
    types, ids = _module_types(model), _ids()
    with torch.no_grad():
        stock = model(ids).logits
    sp_model = parallelize(model, make_parallel_state(1), ParallelizeConfig(attn_implementation="sdpa",
                                                                      local_seq_len=LENGTH, tiled_mlp=2))
    assert (config.to_dict(), config._attn_implementation) == before  # the model runs on its own copy
    assert sp_model.config is not config and sp_model.config._attn_implementation.startswith("ulysses_sp1")
    reference_model = build_model(config, torch.float32, seed=0)  # built from the caller's config meanwhile: stock
    with torch.no_grad():
        assert torch.equal(reference_model(ids).logits, stock)
    back = unparallelize(sp_model)
    assert back is model and back.config is config and _module_types(back) == types
    assert not back.model.layers[0].gradient_checkpointing
    with torch.no_grad():
        assert torch.equal(back(ids).logits, stock)  # stock logits, bitwise
    with pytest.raises(RuntimeError, match="this model was unparallelized"):
        sp_model.logits(ids)
    del sp_model, back, model
    gc.collect()
    with torch.no_grad():  # once the wrapper is gone the caller's config still builds a model (no unknown attention)
        assert torch.equal(build_model(config, torch.float32, seed=0)(ids).logits, stock)


@pytest.mark.parametrize("bad, pattern", [
    (dict(loss_type="bogus"), r"loss_type 'bogus' is unknown; use one of chunked_nll, nll"),
    (dict(tiled_mlp=0), r"tiled_mlp"),
    # the kernels by the planner's rule (vocabulary/names.choose_kernels): refused as the trainer refuses it
    (dict(lean_norm=False, norm_kernel="triton"), r"norm_kernel triton is the lean norms' kernel: set lean_norm true"),
])
def test_a_refused_parallelize_changes_nothing(bad, pattern):
    config = _config()
    model = build_model(config, torch.float32, seed=0)
    before = (config.to_dict(), config._attn_implementation)
    types = _module_types(model)
    with pytest.raises(ConfigError, match=pattern):
        parallelize(model, make_parallel_state(1), ParallelizeConfig(attn_implementation="sdpa", **bad))
    assert (config.to_dict(), config._attn_implementation) == before and _module_types(model) == types


def test_a_parallelize_failing_half_way_leaves_the_model_as_it_was(monkeypatch):
    from ulysses_trainer.families import family
    from ulysses_trainer.families import installs as install
    from ulysses_trainer.levers.lean_norm import LeanRMSNorm
    from ulysses_trainer.parallel.integrations import attention_registered

    config = _config()
    model = build_model(config, torch.float32, seed=0)
    types, ids = _module_types(model), _ids()
    with torch.no_grad():
        stock = model(ids).logits
    names_before = {n for n in __import__("transformers").AttentionInterface._global_mapping if n.startswith("ulysses")}

    def broken(*args, **kwargs):  # after the attention, the loss head and the lean norms were installed
        assert any(isinstance(m, LeanRMSNorm) for m in model.modules())
        raise RuntimeError("the MLP block could not be installed")

    monkeypatch.setitem(install._INSTALLS, type(family("qwen3").mlp), broken)
    with pytest.raises(RuntimeError, match="could not be installed"):
        parallelize(model, make_parallel_state(1), ParallelizeConfig(attn_implementation="sdpa"))
    assert _module_types(model) == types and model.config is config
    assert config._attn_implementation == "sdpa"
    names_after = {n for n in __import__("transformers").AttentionInterface._global_mapping if n.startswith("ulysses")}
    assert names_after == names_before and not any(attention_registered(n) for n in names_after - names_before)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, stock)


def test_misuse_of_the_wrapper_is_one_clear_error():
    config = _config()
    sp_model = parallelize(build_model(config, torch.float32, seed=0), make_parallel_state(1),
                     ParallelizeConfig(attn_implementation="sdpa"))
    ids = _ids()
    shard = shard_batch(ids, sp_size=1, sp_rank=0)
    with pytest.raises(ValueError, match=r"this rank holds 32 tokens per row, and 32 x sp_size 1 = 32 is not the row's "
                                         r"64 tokens: each SP rank takes its L/sp slice"):
        sp_model(**{**shard.model_inputs(), "context": dataclasses.replace(shard.context, seq_len=64)})
    with pytest.raises(TypeError, match="already parallelized"):
        parallelize(sp_model, make_parallel_state(1), ParallelizeConfig(attn_implementation="sdpa"))
    with pytest.raises(TypeError, match="unparallelize takes what parallelize returned"):
        unparallelize(sp_model.causal_lm)


def test_stock_state_dict_loads_into_a_stock_model_without_missing_or_unexpected_keys():
    config = _config()
    sp_model = parallelize(build_model(config, torch.float32, seed=1), make_parallel_state(1),
                     ParallelizeConfig(attn_implementation="sdpa", local_seq_len=LENGTH, tiled_mlp=2))
    state = stock_state_dict(sp_model)
    assert not any(k.startswith("causal_lm.") for k in state)
    stock = build_model(config, torch.float32, seed=2)  # other weights
    result = stock.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    ids = _ids(3)
    with torch.no_grad():
        assert torch.equal(stock(ids).logits, unparallelize(sp_model)(ids).logits)


# ---------------------------------------------------------------- sp=2: ranks as threads
def _sp2(models, ids, pos, rank, world_size, job):
    state = make_parallel_state(world_size)
    model = parallelize(models[rank], state, ParallelizeConfig(attn_implementation="sdpa", loss_chunk_size=7,
                                                               tiled_mlp=False, gradient_checkpointing=False))
    return job(model, state, ids, pos)


def _logits(model, state, ids, pos):
    s = ids.shape[1] // state.sp_size
    mine = ids[:, state.sp_rank * s:(state.sp_rank + 1) * s]  # this rank's slice; position_ids left to the default
    with torch.no_grad():
        logits = model.logits(mine)
        hidden = model.final_hidden(mine)
    assert logits.shape == (1, s, model.config.vocab_size) and logits.dtype == torch.float32
    assert hidden.shape == (1, s, 64)
    pieces = [torch.empty_like(logits[0]) for _ in range(state.sp_size)]
    torch.distributed.all_gather(pieces, logits[0].contiguous(), group=state.sp_group)
    full = torch.cat(pieces)  # [s, V] per rank -> [L, V], in rank order
    errors = []
    for bad in (None, ShardContext.for_rows(ids, state.sp_rank, pos)):  # the whole row on every rank
        try:
            model.logits(ids, bad)
        except ValueError as exc:
            errors.append(str(exc))
    try:  # a plain forward of the parallelized HF model (the whole row, bypassing the wrapper)
        model.causal_lm(input_ids=ids, use_cache=False)
    except RuntimeError as exc:
        errors.append(str(exc))
    return full, errors


def test_logits_gives_each_ranks_logits_and_an_unsharded_row_is_refused():
    ids, pos = make_batch(1, 24, None, seed=4)
    ref_model = build_reference_model(2)
    with torch.no_grad():
        stock = ref_model(input_ids=ids, position_ids=pos).logits[0]
    models = [build_reference_model(2) for _ in range(2)]
    for m in models:
        m.load_state_dict(ref_model.state_dict())
    out = run_threads(2, lambda rank, world_size: _sp2(models, ids, pos, rank, world_size, _logits))
    for full, errors in out:
        assert torch.linalg.norm(full - stock) / torch.linalg.norm(stock) <= 1e-5
        assert len(errors) == 3 and all("tokens per rank x sp is not the row" in e for e in errors[:2]), errors
        assert re.search(r"runs only through the SequenceParallelCausalLM parallelize returned.*"
                         r"ulysses_trainer\.unparallelize\(model\) gives the stock model back", errors[2]), errors


def _loop_without_engine(model, state, ids, pos):
    """docs/library-api.md, 'Without a DeepSpeed engine': one step's gradients."""
    from ulysses_trainer import global_loss, step_token_count

    shard = shard_batch(ids, position_ids=pos, sp_size=state.sp_size, sp_rank=state.sp_rank)
    tokens = step_token_count(shard.num_valid, state)  # valid tokens of the whole step, all ranks
    loss_sum = model(**shard.model_inputs())  # this rank's sum of token losses
    (loss_sum / tokens).backward()  # this rank's share of the step's mean loss
    for p in model.parameters():  # every rank holds the whole model: the step's gradient is the sum over ranks
        if p.grad is not None:
            torch.distributed.all_reduce(p.grad)
    grads = {n.removeprefix("causal_lm."): p.grad.clone() for n, p in model.named_parameters()}
    return float(global_loss(float(loss_sum.detach()), tokens, state)), grads


@pytest.mark.parametrize("docs", [None, [9, 14, 6]])
def test_the_loop_without_an_engine_equals_the_unsharded_reference(docs):
    ids, pos = make_batch(2, 29, docs, seed=3)
    ref_loss, ref_grads = reference(ids, pos, 2)
    models = [build_reference_model(2) for _ in range(2)]
    out = run_threads(2, lambda rank, world_size: _sp2(models, ids, pos, rank, world_size, _loop_without_engine))
    for loss, grads in out:  # every rank: the whole step's loss and gradient, before its optimizer step
        assert abs(loss - ref_loss) / abs(ref_loss) <= 1e-5
        for name, ref in ref_grads.items():
            assert torch.linalg.norm(grads[name] - ref) / torch.linalg.norm(ref) <= 1e-5, name


def test_apply_refuses_other_tiles_than_parallelize_installed():
    """The MLP tiles are installed with the model (parallelize) and read from the setup it keeps: a later `apply` of
    a setup with another count is refused naming the fix; the same count applies."""
    from ulysses_trainer.model.parallelize import apply

    model = build_model(_config(), torch.float32, seed=0)
    cfg = ParallelizeConfig(attn_implementation="sdpa", local_seq_len=LENGTH, tiled_mlp=2)
    sp_model = parallelize(model, make_parallel_state(1), cfg)
    assert sp_model.setup.levers.tiled_mlp == 2
    apply(sp_model, sp_model.setup)  # the same tiles: fine
    other = dataclasses.replace(sp_model.setup, levers=dataclasses.replace(sp_model.setup.levers, tiled_mlp=3))
    with pytest.raises(ValueError, match="the plan has 3 MLP tiles but parallelize installed 2.*tiled_mlp=3"):
        apply(sp_model, other)
