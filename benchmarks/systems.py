"""The three systems compared by benchmarks/long_context.py, each at its recommended settings.

- ours: ulysses_trainer.parallelize (chunked loss, tiled MLP, per-layer checkpoints kept on the GPU
  or offloaded through the pinned pool as memory requires, fastest attention kernel).
- alst: DeepSpeed's ALST pieces on one GPU (sp=1, so UlyssesSPAttentionHF is a no-op): TiledMLP and
  TiledFusedLogitsLoss from deepspeed.runtime.sequence_parallel.ulysses_sp, with transformers'
  checkpoint offload (gradient_checkpointing_enable(offload=True)), SDPA.
- hf: plain Hugging Face: SDPA, gradient checkpointing, full logits and HF's own loss.
Each returns an nn.Module whose forward(input_ids, position_ids) gives the mean token loss.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ulysses_trainer.parallel.sharding import shard_batch
from ulysses_trainer.parallel.state import single_process_state


class OursLoss(nn.Module):
    def __init__(self, model, kernel: str, seq_len: int, offload, under_zero3: bool = True,
                 lean_norm: bool = True, checkpoint_every: int = 1, keep_attention_outputs=False,
                 tiled_mlp="auto", norm_kernel: str = "auto"):
        super().__init__()
        from ulysses_trainer.model.parallelize import ParallelizeConfig, parallelize

        self.sp_model = parallelize(model, single_process_state(), ParallelizeConfig(
            attn_implementation=kernel, tiled_mlp=tiled_mlp, gradient_checkpointing=True,
            activation_offload=offload, local_seq_len=seq_len, lean_norm=lean_norm,
            checkpoint_every=checkpoint_every, keep_attention_outputs=keep_attention_outputs, norm_kernel=norm_kernel))

    def forward(self, input_ids, position_ids):
        shard = shard_batch(input_ids, position_ids=position_ids, sp_size=1, sp_rank=0)
        return self.sp_model(**shard.model_inputs()) / max(shard.num_valid, 1)


def _alst_tiled_mlp(mlp):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def forward(x):  # DeepSpeed's documented TiledMLP recipe (sp=1: no cross-rank agreement needed)
        shards = math.ceil(x.shape[1] / x.shape[2])
        params = [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight]
        return TiledMLP.apply(lambda self, t: self.down_proj(self.act_fn(self.gate_proj(t)) * self.up_proj(t)),
                              mlp, x, shards, params)

    return forward


class ALSTLoss(nn.Module):
    def __init__(self, model, kernel: str, seq_len: int, offload=True, under_zero3: bool = True):
        super().__init__()
        self.model = model
        if under_zero3 and model.lm_head.weight is model.model.embed_tokens.weight:
            # TiledFusedLogitsLoss runs the lm_head backward inside forward; with a tied weight ZeRO-3 then
            # sees the same parameter's gradient twice (stage3 asserts on duplicate ds_id). Untie it.
            model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
            model.config.tie_word_embeddings = False
            self.untied_lm_head = True
        for layer in model.model.layers:
            layer.mlp.forward = _alst_tiled_mlp(layer.mlp)  # the instance-level override DeepSpeed documents
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, offload=offload)
        model.set_attn_implementation(kernel)
        model.train()

    def forward(self, input_ids, position_ids):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

        hidden = self.model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        labels = torch.nn.functional.pad(input_ids[:, 1:], (0, 1), value=-100)
        lm_head = self.model.lm_head

        def loss_fn(head, x, y):
            return torch.nn.functional.cross_entropy(head(x).float().view(-1, head.out_features), y.view(-1),
                                                     ignore_index=-100, reduction="sum")

        shards = math.ceil(input_ids.shape[1] / 1024)
        total = TiledFusedLogitsLoss.apply(loss_fn, lm_head, hidden, labels, None, shards, [lm_head.weight], "sum")
        return total / (input_ids.shape[1] - 1)


class HFLoss(nn.Module):
    def __init__(self, model, kernel: str, seq_len: int, offload=False, under_zero3: bool = True):
        super().__init__()
        self.model = model
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.set_attn_implementation(kernel)
        model.train()

    def forward(self, input_ids, position_ids):
        return self.model(input_ids=input_ids, position_ids=position_ids, labels=input_ids, use_cache=False).loss


SYSTEMS = {"ours": OursLoss, "alst": ALSTLoss, "hf": HFLoss}
