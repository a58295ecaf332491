"""Chunked lm_head + cross-entropy: the token-NLL sum without ever holding the N×V logits.

At 1M tokens and a 151,936-word vocabulary the full logits are hundreds of GB, so the loss walks
`chunk_size`-row chunks. Each chunk's logits are built in fp32, turned into its loss and its dlogits
(softmax − onehot, training dtype) and freed before the next chunk; the dlogits of GRAD_GROUP chunks
then give the gradients of the hidden states and of the lm_head weight in two long matmuls.
backward() then only scales the stored gradients by grad_output.

The weight is an input of the autograd.Function and its gradient is returned from backward(), so
DeepSpeed ZeRO-3 sees an ordinary gradient on an ordinary parameter (its hooks fire once, in the
engine's backward, after loss scaling and 1/accumulation scaling are applied through grad_output).
Under ZeRO-3 the caller must pass the gathered weight (call this inside the lm_head's forward or a
GatheredParameters block).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import ConfigError
from ..parallel.sharding import IGNORE_INDEX

GRAD_GROUP = 8  # chunks whose dlogits are gathered before the gradient matmuls (see _ChunkedNLLSum)


def count_valid(labels: Tensor) -> int:
    """Number of labels that count towards the loss (not IGNORE_INDEX). Syncs with the device."""
    return int((labels != IGNORE_INDEX).sum().item())


def softcapped(logits: Tensor, softcap: float | None) -> Tensor:
    """cap * tanh(logits / cap), the final-logit soft-capping of a config's final_logit_softcapping (Gemma);
    None: the logits as they are."""
    return logits if not softcap else torch.tanh(logits / softcap) * softcap


def nll_sum(hidden: Tensor, weight: Tensor, labels: Tensor, softcap: float | None = None,
            logits_scaling: float = 1.0) -> Tensor:
    """Reference: full logits in the input dtype (divided by logits_scaling, as Granite's head does), upcast to
    fp32 (soft-capped where `softcap` is given), summed cross-entropy (fp32 scalar)."""
    logits = F.linear(hidden, weight)  # [..., V]
    if logits_scaling != 1.0:
        logits = logits / logits_scaling
    logits = softcapped(logits.float(), softcap)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def _check_inputs(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ConfigError(f"loss_chunk_size must be an int >= 1 (rows per chunk), got {chunk_size!r}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden [..., H] and weight [V, H] disagree on H: hidden {tuple(hidden.shape)}, "
                         f"weight {tuple(weight.shape)}; pass the lm_head weight")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels {tuple(labels.shape)} must have hidden's leading dims "
                         f"{tuple(hidden.shape[:-1])}; shift the labels, do not drop a position")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype; "
                         "cast the hidden states to the lm_head dtype")


class _ChunkedNLLSum(torch.autograd.Function):
    """sum of token NLLs; forward also computes the gradients, backward only scales them."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int,
                want_hidden_grad: bool, want_weight_grad: bool, softcap: float | None = None,
                logits_scaling: float = 1.0) -> Tensor:
        n_hidden = hidden.shape[-1]
        h2d = hidden.reshape(-1, n_hidden)  # [..., H] -> [N, H]
        y = labels.reshape(-1)  # [...] -> [N]
        n_rows = h2d.shape[0]
        valid = y != IGNORE_INDEX  # [N]

        # One host sync up front: how many valid labels each chunk holds (chunks with none add 0).
        n_chunks = -(-n_rows // chunk_size)
        pad = n_chunks * chunk_size - n_rows
        per_chunk = (F.pad(valid.int(), (0, pad)).view(n_chunks, chunk_size).sum(1).tolist()  # [n_chunks]
                     if n_rows else [])

        n_vocab = weight.shape[0]
        # The weight gradient is a [V, c] @ [c, H] product: at c = 256 rows the matmul is short and every
        # chunk re-reads and re-writes the whole [V, H] fp32 accumulator (H200, 256K tokens: 2.3 s of a
        # 3.4 s loss). So the chunks' dlogits gather in a buffer of GRAD_GROUP chunks, and the hidden and
        # weight gradients run once per group, over 8x as many rows.
        group_rows = chunk_size * GRAD_GROUP
        # A vocab block of the weight gradient about as large as one chunk's logits (the temporary it
        # needs), a multiple of 64 rows so that every block starts 128-byte aligned (fast GEMM kernels).
        vocab_block = max(64, (chunk_size * n_vocab // n_hidden) // 64 * 64)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.zeros_like(h2d) if want_hidden_grad else None  # [N, H], input dtype
        grad_w = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                  if want_weight_grad else None)  # [V, H], fp32 accumulator
        wants_grad = grad_h is not None or grad_w is not None
        dbuf = None  # [group_rows, V] dlogits of one group of chunks, input dtype

        for g0 in range(0, n_chunks, GRAD_GROUP):
            chunks = range(g0, min(g0 + GRAD_GROUP, n_chunks))
            if not any(per_chunk[c] for c in chunks):  # every label ignored: no loss, zero gradient rows
                continue
            gs, ge = g0 * chunk_size, min((chunks[-1] + 1) * chunk_size, n_rows)
            if wants_grad and dbuf is None:
                dbuf = torch.empty((min(group_rows, n_rows), n_vocab), dtype=h2d.dtype, device=h2d.device)
            for c in chunks:
                s, e = c * chunk_size, min((c + 1) * chunk_size, n_rows)
                if per_chunk[c] == 0:
                    if wants_grad:
                        dbuf[s - gs:e - gs].zero_()  # ignored rows have zero dlogits
                    continue
                h, yc, vc = h2d[s:e], y[s:e], valid[s:e]
                logits = torch.mm(h, weight.t()).float()  # [c, V]: input-dtype matmul, fp32 softmax
                if logits_scaling != 1.0:
                    logits.div_(logits_scaling)  # Granite: the logits divided, as its head does
                if softcap:  # cap * tanh(z / cap); its derivative 1 - tanh^2 scales the dlogits below
                    tanh = logits.div_(softcap).tanh_()  # [c, V], in place of z
                    logits = tanh * softcap
                lse = torch.logsumexp(logits, dim=-1)  # [c]
                tgt_idx = torch.where(vc, yc, 0).unsqueeze(1)  # [c, 1]
                tgt = logits.gather(1, tgt_idx).squeeze(1)  # [c]
                total += torch.where(vc, lse - tgt, 0.0).sum()
                if not wants_grad:
                    continue
                # d(sum NLL)/d(logits) = softmax − onehot(target) on valid rows, 0 on ignored rows.
                probs = logits.sub_(lse.unsqueeze(1)).exp_()  # [c, V], in place: logits are no longer needed
                probs.masked_fill_(~vc.unsqueeze(1), 0.0)
                probs.scatter_add_(1, tgt_idx, -vc.to(probs.dtype).unsqueeze(1))
                if softcap:
                    probs.mul_(tanh.square_().neg_().add_(1.0))  # d(capped)/dz = 1 - tanh^2
                    del tanh
                if logits_scaling != 1.0:
                    probs.div_(logits_scaling)  # the division's backward: d(logits before it) = d(logits) / s
                dbuf[s - gs:e - gs].copy_(probs)  # [c, V] fp32 -> input dtype, rows of the group
                del logits, probs
            if not wants_grad:
                continue
            dl, hg = dbuf[:ge - gs], h2d[gs:ge]  # [g, V], [g, H]
            if grad_h is not None:
                torch.mm(dl, weight, out=grad_h[gs:ge])  # [g, V] @ [V, H] -> [g, H]
            if grad_w is not None:
                if dl.dtype == torch.float32:
                    grad_w.addmm_(dl.t(), hg)  # no [V, H] temporary in fp32
                else:  # input-dtype matmul added in fp32, a vocab block at a time: no [V, H] temporary
                    for v0 in range(0, n_vocab, vocab_block):
                        v1 = min(v0 + vocab_block, n_vocab)
                        grad_w[v0:v1].add_(torch.mm(dl[:, v0:v1].t(), hg))  # [vb, g] @ [g, H]
        del dbuf

        ctx.hidden_shape = hidden.shape
        ctx.hidden_dtype = hidden.dtype
        ctx.weight_dtype = weight.dtype
        ctx.chunk_size = chunk_size
        ctx.has_grad_h = grad_h is not None
        ctx.has_grad_w = grad_w is not None
        ctx.save_for_backward(*(g for g in (grad_h, grad_w) if g is not None))
        return total

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        saved = list(ctx.saved_tensors)
        grad_h = saved.pop(0) if ctx.has_grad_h else None
        grad_w = saved.pop(0) if ctx.has_grad_w else None
        scale = grad_output.float()
        # Scaling in place keeps the peak at the stored gradients; a second backward through this
        # graph fails loudly (saved-tensor version check) instead of reusing scaled values.
        if grad_h is not None:
            if grad_h.dtype == torch.float32:
                grad_h.mul_(scale)
            else:  # scale in fp32, round once, a chunk of rows at a time (no [N, H] fp32 copy)
                for blk in grad_h.split(ctx.chunk_size):
                    blk.copy_(blk.float().mul_(scale))
            grad_h = grad_h.view(ctx.hidden_shape).to(ctx.hidden_dtype)  # [N, H] -> [..., H]
        if grad_w is not None:
            grad_w = grad_w.mul_(scale).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None, None, None


BUCKET_COLUMNS = ("nll", "hits", "tokens")  # the columns of chunked_bucket_sums


@torch.no_grad()
def chunked_bucket_sums(hidden: Tensor, weight: Tensor, labels: Tensor, buckets: Tensor, num_buckets: int,
                        chunk_size: int = 256, softcap: float | None = None, logits_scaling: float = 1.0) -> Tensor:
    """Evaluation's sums by bucket, never building the full logits: [num_buckets, 3] float64, per bucket the sum
    of token NLLs, the tokens whose label is an argmax of their logits (teacher-forced hits) and the tokens,
    over labels != IGNORE_INDEX. buckets: labels' shape, each token's bucket in [0, num_buckets). No gradient.

    The logits and NLLs are chunked_nll_sum's (input-dtype matmul, fp32 softmax); only the sums differ."""
    _check_inputs(hidden, weight, labels, chunk_size)
    if tuple(buckets.shape) != tuple(labels.shape):
        raise ValueError(f"buckets {tuple(buckets.shape)} must have labels' shape {tuple(labels.shape)}")
    h2d = hidden.reshape(-1, hidden.shape[-1])  # [..., H] -> [N, H]
    y, b = labels.reshape(-1), buckets.reshape(-1)  # [...] -> [N]
    n_rows = h2d.shape[0]
    n_chunks = -(-n_rows // chunk_size)
    valid = y != IGNORE_INDEX  # [N]
    pad = n_chunks * chunk_size - n_rows
    # one host sync up front: chunks without a valid label are skipped (a recall probe labels a few tokens)
    per_chunk = F.pad(valid.int(), (0, pad)).view(n_chunks, chunk_size).sum(1).tolist() if n_rows else []
    sums = torch.zeros(len(BUCKET_COLUMNS), num_buckets, dtype=torch.float64, device=hidden.device)  # [3, k]
    for c in range(n_chunks):
        if per_chunk[c] == 0:
            continue
        s, e = c * chunk_size, min((c + 1) * chunk_size, n_rows)
        vc = valid[s:e]
        logits = torch.mm(h2d[s:e], weight.t()).float()  # [c, V]: input-dtype matmul, fp32 softmax
        if logits_scaling != 1.0:
            logits.div_(logits_scaling)
        logits = softcapped(logits, softcap)
        tgt = logits.gather(1, torch.where(vc, y[s:e], 0).unsqueeze(1)).squeeze(1)  # [c]
        nll = torch.logsumexp(logits, dim=-1) - tgt  # [c]
        hit = tgt >= logits.amax(dim=-1)  # [c]: the label is an argmax (a tie counts)
        idx = b[s:e][vc]  # [valid in chunk]
        sums[0].index_add_(0, idx, nll[vc].double())
        sums[1].index_add_(0, idx, hit[vc].double())
        sums[2].index_add_(0, idx, torch.ones_like(idx, dtype=torch.float64))
        del logits
    return sums.t()  # [3, k] -> [k, 3]


def chunked_nll_sum(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int = 256,
                    softcap: float | None = None, logits_scaling: float = 1.0) -> Tensor:
    """fp32 sum of token NLLs over labels != IGNORE_INDEX, never building the full logits; `softcap`: the logits
    soft-capped first (cap * tanh(logits / cap), a config's final_logit_softcapping), chunk by chunk;
    `logits_scaling`: every logit divided by it before (Granite's head).

    hidden [..., H], weight [V, H] (the lm_head weight, tied or not), labels [...] already shifted.
    Returns 0.0 (not NaN) when every label is ignored. Gradients are computed only for the inputs
    that need them under the current grad mode (none in eval). logits_scaling: the logits are divided by it
    (Granite's config field; 1: none).
    """
    _check_inputs(hidden, weight, labels, chunk_size)
    grad_on = torch.is_grad_enabled()
    return _ChunkedNLLSum.apply(hidden, weight, labels, chunk_size,
                                grad_on and hidden.requires_grad, grad_on and weight.requires_grad, softcap,
                                float(logits_scaling))
