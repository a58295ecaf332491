"""ulysses_trainer: exact Ulysses sequence-parallel training of Hugging Face Qwen3 under DeepSpeed ZeRO-3.

The library API, for users who bring their own loop (examples/own_loop.py runs it end to end)::

    init_distributed("nccl")                              # deepspeed's, minus its CPU shm op on "gloo"
    state = make_parallel_state(sp_size)                  # dp x sp groups
    model = parallelize(hf_model, state, ParallelizeConfig(local_seq_len=L // sp))
    config = fill_zero_config("ds_configs/zero3.json", world_size=state.world_size, dp_size=state.dp_size,
                              micro_batch=1, lr=1e-4)     # every "auto" filled
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(...), config=config)
    shard = shard_batch(input_ids, sp_size=state.sp_size, sp_rank=state.sp_rank)
    tokens = step_token_count(shard.num_valid, state)      # over every rank and micro-step of the step
    loss_sum = engine(**shard.model_inputs())
    engine.backward(loss_for_backward(loss_sum, tokens, state), scale_wrt_gas=False)
    engine.step()
    destroy_distributed()                                 # before exit: gloo aborts otherwise
"""

from importlib import import_module
from typing import Any

# The API loads on first use (PEP 562): `ulysses-trainer` and `launch/train.py` import the package without
# torch, so a Ctrl-C during torch's import lands in code that says one line instead of a traceback.
_WHERE = {
    "fill_zero_config": ".ds_config",
    "ParallelizeConfig": ".model.parallelize", "SequenceParallelCausalLM": ".model.parallelize",
    "parallelize": ".model.parallelize", "unparallelize": ".model.parallelize",
    "save_stock_model": ".model.stock", "stock_state_dict": ".model.stock",
    "destroy_distributed": ".parallel.init", "init_distributed": ".parallel.init",
    "global_loss": ".parallel.loss", "loss_for_backward": ".parallel.loss", "step_token_count": ".parallel.loss",
    "Shard": ".parallel.sharding", "ShardContext": ".parallel.sharding", "shard_batch": ".parallel.sharding",
    "ParallelState": ".parallel.state", "make_parallel_state": ".parallel.state",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'ulysses_trainer' has no attribute {name!r}")
    value = getattr(import_module(_WHERE[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
