"""Bring your own loop: Ulysses sequence parallelism under DeepSpeed ZeRO-3, without the trainer.

    deepspeed --num_gpus 2 examples/own_loop.py --sp_size 2     # (or torchrun --nproc_per_node 2 ...)

A real HF Qwen3 (the `tiny` preset, random weights; `--model qwen3-4b` for the real size), the Qwen
tokenizer on synthetic documents, the shipped ds_configs/zero3.json with its "auto" values filled.
Each optimizer step trains one sequence per dp rank, split over the sp ranks; rank 0 prints the
token-weighted loss of the step. Runs on CPU ranks (gloo, fp32) and on GPUs (nccl, bf16).
"""

import argparse
import os
import random

import deepspeed
import torch

from ulysses_trainer import (
    ParallelizeConfig,
    destroy_distributed,
    fill_zero_config,
    global_loss,
    init_distributed,
    loss_for_backward,
    make_parallel_state,
    parallelize,
    save_stock_model,
    shard_batch,
    step_token_count,
)
from ulysses_trainer.data.synthetic import synthetic_document
from ulysses_trainer.data.tokenizer import QwenBPETokenizer
from ulysses_trainer.families.presets import preset_config
from ulysses_trainer.model.load import build_model


def sequence(tokenizer: QwenBPETokenizer, index: int, length: int) -> torch.Tensor:
    """Token ids [1, length]: synthetic documents joined by EOS, the same for every rank that asks for `index`."""
    rng, ids = random.Random(index), []
    while len(ids) < length:
        ids += tokenizer.encode(synthetic_document(rng, num_words=length)) + [tokenizer.eos_token_id]
    return torch.tensor(ids[:length]).unsqueeze(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sp_size", type=int, default=None, help="ranks per sequence; default all (dp = 1)")
    parser.add_argument("--model", default="tiny", help="a Qwen3 preset (tiny, qwen3-0.6b ... qwen3-32b)")
    parser.add_argument("--max_length", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--save_dir", default=None, help="write the trained weights there, with the stock keys")
    parser.add_argument("--local_rank", type=int, default=0)  # added by the deepspeed launcher
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda" if cuda else "cpu")
    init_distributed("nccl" if cuda else "gloo")
    state = make_parallel_state(args.sp_size)  # dp x sp groups: sp = consecutive ranks, inside a node

    config = preset_config(args.model)
    with device:  # random init, seeded: every rank starts from the same weights
        hf_model = build_model(config, torch.bfloat16 if cuda else torch.float32, seed=0)
    model = parallelize(hf_model, state, ParallelizeConfig(local_seq_len=args.max_length // state.sp_size))
    zero3 = fill_zero_config("ds_configs/zero3.json", world_size=state.world_size, dp_size=state.dp_size,
                             micro_batch=1, grad_accum=1, lr=args.lr, bf16=cuda, hidden_size=config.hidden_size)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr),
                                      config=zero3)

    tokenizer = QwenBPETokenizer()
    for step in range(args.steps):
        input_ids = sequence(tokenizer, step * state.dp_size + state.dp_rank, args.max_length)  # [1, L]
        position_ids = torch.arange(args.max_length).unsqueeze(0)  # one document per row: 0..L-1
        shard = shard_batch(input_ids, position_ids=position_ids, sp_size=state.sp_size,
                            sp_rank=state.sp_rank).to(device)  # my L/sp tokens, labels shifted before slicing
        tokens = step_token_count(shard.num_valid, state)  # valid tokens of the whole step, all ranks
        loss_sum = engine(**shard.model_inputs())  # this rank's sum of token losses (fp32)
        engine.backward(loss_for_backward(loss_sum, tokens, state), scale_wrt_gas=False)
        engine.step()
        loss = global_loss(float(loss_sum.detach()), tokens, state)  # token-weighted mean over all ranks
        if state.is_main:
            print(f"step {step + 1} loss {loss!r}", flush=True)
    if args.save_dir:  # every rank (ZeRO-3 gathers); rank 0 writes pytorch_model.bin with the stock model's keys
        save_stock_model(engine, args.save_dir)
    destroy_distributed()  # every rank leaves together: gloo can abort at exit otherwise


if __name__ == "__main__":
    main()
