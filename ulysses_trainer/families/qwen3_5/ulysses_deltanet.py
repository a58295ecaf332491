"""Ulysses for Gated DeltaNet layers (Qwen3.5's linear attention): the layer's heads split over the SP group.

Why this is exact. A DeltaNet layer is, per head, a causal depthwise conv (kernel 4) over that head's q/k/v
channels followed by a recurrence over the whole sequence; nothing mixes heads until the output projection. So
the layer splits by head like softmax attention: each rank projects its s/sp tokens (all channels), an
all-to-all hands it all s tokens of its heads' channels, and the conv and the recurrence then run on the whole
sequence exactly as on one GPU. The all-to-all comes BEFORE the conv: the conv is per channel and causal over
the sequence, so after it no window is cut at a rank boundary. The output (per head) goes back by the reverse
all-to-all; the gated RMSNorm (per head and token, its weight shared by all heads) and the output projection
then run on the rank's own tokens with its own z (which never travels).

Channel layout. in_proj_qkv's output (and the conv's channels) is [q: K heads x dk | k: K heads x dk |
v: V heads x dv]; in_proj_b / in_proj_a give one value per value head. Rank r takes key heads
r*K/sp .. (r+1)*K/sp - 1 and value heads r*V/sp .. (r+1)*V/sp - 1: with V = m*K, value head j reads key head
j // m, so a rank's value heads read exactly its key heads. The conv weight's rows for those channels, and
A_log / dt_bias for those heads, are slices of the parameters taken inside the forward (never copies), so
ZeRO-3 gathers and reduces the whole tensors as usual. sp must divide K and V (vocabulary/layout.check_heads).

Packed documents: the conv and the recurrence restart at every document start of cu_seqlens (the full
sequence's, which is what a rank holds after the all-to-all).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...parallel.comm import heads_to_seq, seq_to_heads
from ...parallel.sharding import ShardContext
from ...parallel.state import ParallelState
from .deltanet_kernels import CONV_FUNCTIONS, DELTANET_FUNCTIONS


class ChannelConv(nn.Module):
    """The layer's depthwise conv weight under its own name (`conv1d.weight`, the same Parameter: no copy), run on
    the channels a rank holds. A module of its own so that ZeRO-3 gathers the weight when it runs."""

    def __init__(self, conv: nn.Conv1d, kernel: str):
        super().__init__()
        assert conv.bias is None, "Qwen3.5's DeltaNet conv has no bias"
        self.weight = conv.weight  # [C, 1, k]
        self.kernel_size = conv.kernel_size
        self.conv = CONV_FUNCTIONS[kernel]

    def forward(self, x: Tensor, channels: list[slice], cu_seqlens: Tensor | None) -> Tensor:
        w = self.weight.squeeze(1)  # [C, 1, k] -> [C, k]
        w = torch.cat([w[c] for c in channels])  # [C/sp, k]: this rank's channels, in x's order
        return self.conv(x, w, cu_seqlens)  # [b, s, C/sp] -> [b, s, C/sp], SiLU applied


class UlyssesGatedDeltaNet(nn.Module):
    """Drop-in for transformers' Qwen3_5GatedDeltaNet (and the MoE model's): its projections, conv, A_log,
    dt_bias and gated norm adopted under the same names (state-dict keys unchanged), run with the heads split
    over the SP group. forward(hidden [b, s/sp, H]) -> [b, s/sp, H]."""

    def __init__(self, net: nn.Module, state: ParallelState, kernel: str):
        super().__init__()
        if kernel not in DELTANET_FUNCTIONS:
            raise ValueError(f"deltanet kernel {kernel!r} is not one of {', '.join(DELTANET_FUNCTIONS)}")
        self.in_proj_qkv, self.in_proj_z = net.in_proj_qkv, net.in_proj_z
        self.in_proj_b, self.in_proj_a = net.in_proj_b, net.in_proj_a
        self.conv1d = ChannelConv(net.conv1d, kernel)
        self.dt_bias, self.A_log = net.dt_bias, net.A_log
        self.norm, self.out_proj = net.norm, net.out_proj
        self.layer_idx = net.layer_idx
        self.state, self.kernel = state, kernel
        self.rule = DELTANET_FUNCTIONS[kernel]
        sp_size = state.sp_size
        self.nk, self.nv, self.dk, self.dv = net.num_k_heads, net.num_v_heads, net.head_k_dim, net.head_v_dim
        if self.nk % sp_size or self.nv % sp_size:
            raise ValueError(f"sp_size={sp_size} must divide the DeltaNet's {self.nk} key and {self.nv} value heads")
        self.k_local, self.v_local = self.nk // sp_size, self.nv // sp_size
        r, key_dim = state.sp_rank, self.nk * self.dk
        kw, vw = self.k_local * self.dk, self.v_local * self.dv
        # this rank's conv channels: its q heads, its k heads, its v heads ([q | k | v] layout)
        self.channels = [slice(r * kw, (r + 1) * kw), slice(key_dim + r * kw, key_dim + (r + 1) * kw),
                         slice(2 * key_dim + r * vw, 2 * key_dim + (r + 1) * vw)]
        self.heads = slice(r * self.v_local, (r + 1) * self.v_local)  # this rank's value heads

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None,
                sp_context: ShardContext | None = None, **kwargs) -> Tensor:
        assert attention_mask is None, "packed rows carry no padding mask; documents come from cu_seqlens"
        sp_size, group = self.state.sp_size, self.state.sp_group
        b, s_local, _ = hidden_states.shape
        kl, vl, dk, dv = self.k_local, self.v_local, self.dk, self.dv
        qkv = self.in_proj_qkv(hidden_states)  # [b, s/sp, 2*K*dk + V*dv]
        q, k, v = qkv.split([self.nk * dk, self.nk * dk, self.nv * dv], dim=-1)
        beta_in, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)  # [b, s/sp, V] each
        # per rank's heads, packed for one all-to-all: [b, s/sp, sp, kl*dk + kl*dk + vl*dv + vl + vl]
        parts = [t.reshape(b, s_local, sp_size, -1) for t in (q, k, v, beta_in, a)]
        packed = torch.cat(parts, dim=-1)
        # [b, s/sp, sp, c] -> [b, s, 1, c]: all tokens of this rank's heads
        packed = seq_to_heads(packed, sp_size, group).squeeze(2)  # [b, s, c]
        s = packed.shape[1]
        conv_in, beta_in, a = packed.split([2 * kl * dk + vl * dv, vl, vl], dim=-1)
        cu = sp_context.cu_seqlens if sp_context is not None else None  # transformers' layer passes it on
        if cu is not None and cu.device != packed.device:
            cu = cu.to(packed.device)
        if cu is not None and cu.numel() == b + 1:  # one document per row: the plain per-row conv and rule
            cu = None
        mixed = self.conv1d(conv_in, self.channels, cu)  # [b, s, c]
        q, k, v = mixed.split([kl * dk, kl * dk, vl * dv], dim=-1)
        q, k = q.reshape(b, s, kl, dk), k.reshape(b, s, kl, dk)  # [b, s, K/sp, dk]
        v = v.reshape(b, s, vl, dv)  # [b, s, V/sp, dv]; value head j reads key head j // (V / K)
        beta = beta_in.sigmoid()  # [b, s, V/sp]
        g = -self.A_log[self.heads].float().exp() * F.softplus(a.float() + self.dt_bias[self.heads])
        out = self.rule(q, k, v, g, beta, cu)  # [b, s, V/sp, dv]
        out = heads_to_seq(out, sp_size, group)  # [b, s, V/sp, dv] -> [b, s/sp, V, dv]
        z = self.in_proj_z(hidden_states).reshape(b, s_local, self.nv, dv)  # [b, s/sp, V, dv]
        out = self.norm(out.reshape(-1, dv), z.reshape(-1, dv))  # per (token, head): [b*s/sp*V, dv]
        return self.out_proj(out.reshape(b, s_local, self.nv * dv))  # [b, s/sp, H]
