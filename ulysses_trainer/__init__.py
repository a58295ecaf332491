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

from .ds_config import fill_zero_config
from .model.parallelize import ParallelizeConfig, SequenceParallelCausalLM, parallelize
from .parallel.init import destroy_distributed, init_distributed
from .parallel.loss import global_loss, loss_for_backward, step_token_count
from .parallel.sharding import Shard, shard_batch
from .parallel.state import ParallelState, make_parallel_state

__all__ = [
    "ParallelState", "ParallelizeConfig", "SequenceParallelCausalLM", "Shard", "destroy_distributed",
    "fill_zero_config", "global_loss", "init_distributed", "loss_for_backward", "make_parallel_state", "parallelize",
    "shard_batch", "step_token_count",
]
