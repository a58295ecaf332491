"""verify_sp: before step 1, the user's own model under sequence parallelism against the stock transformers model
on the same weights, forward and backward, on the first few thousand tokens of the first training row.

Both run on a private copy of the weights (gathered from the engine as ZeRO-3 gathers them), so the engine, the
optimizer and the RNG are untouched: the first step is the same with the check on or off. The copy is
parallelized with the run's own mechanisms (Ulysses attention across the real SP ranks, the loss head, lean
norms, tiled MLP, checkpointing), each rank runs its shard; `unparallelize` gives the stock model back, and SP
rank 0 runs it on the whole short row, one forward per packed document (one forward of the row where the RoPE picks
its frequencies by the row's longest position: model/row_rope.py). A loss, gradient norm or sampled gradient
outside the exactness tolerances (fp32: 1e-5 relative; bf16: loss 1e-2, gradient norm 5e-2) stops the run
(exit 2) with one line naming the layer type whose output (or, for a backward-only difference, whose gradients)
first differs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..model.parallelize import ParallelizeConfig, parallelize, unparallelize
from ..model.row_rope import chooses_by_longest
from ..parallel.comm import all_reduce, gather_objects, sum_in_place
from ..parallel.sharding import IGNORE_INDEX, shard_batch
from ..parallel.state import ParallelState
from ..vocabulary.layout import padded_length
from ..vocabulary.model_setup import ModelSetup

MAX_TOKENS = 4096  # the row's first tokens the check runs: a few seconds at 8B
# on a CPU run: the stock model's whole-row logits over a 151,669-token vocabulary are 2.5 GB at 4096 tokens and
# most of the check's 18 s on 2 ranks of 2 cores; 1024 tokens still cross every rank boundary of any sp
MAX_TOKENS_CPU = 1024
PROJECTION = 8  # each token's output of a watched module is compared as this many random projections
SAMPLE = 4096  # elements of each parameter's gradient compared one by one (a strided sample)
# (loss, gradient norm and the whole sampled gradient, each parameter's sampled gradient): the exactness
# tolerances (fp32 1e-5; bf16 loss 1e-2, norm 5e-2), and a per-parameter bound that a wrong shard (errors of order 1)
# exceeds and rounding does not: a small parameter's gradient (a DeltaNet layer's A_log, dt_bias) differs by 3e-4
# at 192 tokens between two correct fp32 implementations of the same rule (the trainer's and transformers')
FP32_TOLERANCES = (1e-5, 1e-5, 1e-2)
BF16_TOLERANCES = (1e-2, 5e-2, 0.25)


class VerifySpError(ConfigError):
    """The parallelized model differs from the stock one on the user's model: exit 2, one line."""


def verify_due(setting: bool | str, resuming: bool) -> bool:
    """`auto`: on at a run's first start, off at resume (the check ran when the run started)."""
    if setting == "auto":
        return not resuming
    return bool(setting)


@dataclass
class VerifyResult:
    loss: float  # parallelized (all SP ranks)
    ref_loss: float  # stock
    grad_norm: float
    ref_grad_norm: float
    worst: float  # the largest relative difference of the sampled per-parameter gradients
    worst_param: str
    tokens: int
    seconds: float = 0.0

    def line(self) -> str:
        return (f"verify_sp: loss {self.loss:.8g} vs {self.ref_loss:.8g}, grad norm {self.grad_norm:.8g} vs "
                f"{self.ref_grad_norm:.8g} (parallelized vs stock, {self.tokens} tokens of the first row), largest "
                f"relative difference of a parameter's gradient {self.worst:.2e} ({self.worst_param}), "
                f"{self.seconds:.1f} s")


def _rel(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    ref = float(torch.linalg.vector_norm(b))
    diff = float(torch.linalg.vector_norm(a - b))
    return diff / ref if ref > 0 else diff


def _first_tensor(out) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return getattr(out, "last_hidden_state", None)


def _watched(model: nn.Module) -> list[str]:
    """The modules whose outputs are compared, in the order they run: the embedding, each decoder layer's
    children (attention, token mixer, MLP, norms) then the layer, the final norm."""
    names = [n for n, _ in model.named_modules()]
    layers = [n for n in names if n.count(".") == 2 and n.split(".")[1] == "layers" and n.split(".")[2].isdigit()]
    out = [n for n in names if n.endswith("embed_tokens")][:1]
    for layer in layers:
        out += [n for n in names if n.startswith(layer + ".") and n.count(".") == 3] + [layer]
    return out + [n for n in names if n.count(".") == 1 and n.endswith(".norm")]


def _project(t: torch.Tensor, width: int = PROJECTION) -> torch.Tensor:
    """[b, s, ...] -> [b, s, width] on the host: each token's output times a fixed random matrix (seeded, the
    global RNG untouched), so a layer's output costs kilobytes, not gigabytes, and a wrong token still shows."""
    x = t.detach().float().reshape(t.shape[0], t.shape[1], -1)  # [b, s, d]
    g = torch.Generator(device=x.device).manual_seed(x.shape[-1])
    r = torch.randn(x.shape[-1], width, generator=g, device=x.device, dtype=x.dtype)  # [d, width]
    return (x @ r).double().cpu()


@contextmanager
def _recording(model: nn.Module, names: list[str], store: dict[str, list[torch.Tensor]]) -> Iterator[None]:
    """Each watched module's forward outputs, projected (_project), into store[name], until the context ends."""
    modules = dict(model.named_modules())
    handles = []
    for name in names:
        def hook(_m, _args, out, name=name):
            t = _first_tensor(out)
            if t is not None and t.dim() >= 2:
                store.setdefault(name, []).append(_project(t))
        handles.append(modules[name].register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _sample(g: torch.Tensor) -> torch.Tensor:
    flat = g.detach().reshape(-1).float()
    return flat[::max(1, flat.numel() // SAMPLE)][:SAMPLE].cpu().clone()


def _grads(model: nn.Module, names: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """(a strided sample, the norm) of each trainable parameter's gradient (zeros where it has none)."""
    params = dict(model.named_parameters())
    samples, norms = {}, {}
    for n in names:
        p = params[n]
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        samples[n], norms[n] = _sample(g), float(torch.linalg.vector_norm(g.float()))
    return samples, norms


def _forward_index(param: str, ran: list[str]) -> int:
    """Where the module holding `param` ran in the forward (after every watched module when none holds it:
    lm_head)."""
    owners = [i for i, name in enumerate(ran) if param.startswith(name + ".")]
    return max(owners, key=lambda i: len(ran[i])) if owners else len(ran)


def _layer_type(model: nn.Module, name: str) -> str:
    """The module class a parameter or module name belongs to: the decoder layer's child (attention, MLP, norm)
    for names inside a layer, else the module itself (embedding, final norm, lm_head)."""
    parts = name.split(".")
    modules = dict(model.named_modules())
    if len(parts) > 3 and parts[1] == "layers":
        return type(modules[".".join(parts[:4])]).__name__
    owner = ".".join(parts[:-1]) if name not in modules else name
    return type(modules.get(owner, model)).__name__


def copy_weights(target: nn.Module, source: nn.Module) -> None:
    """target's parameters and buffers <- source's of the same names (target may be uninitialized: every one is
    copied); source's parameters gathered as ZeRO-3 gathers them (every rank of the job calls it: collective under
    ZeRO-3), read only."""
    import deepspeed

    src = dict(source.named_parameters())
    with torch.no_grad():
        for name, p in target.named_parameters():
            s = src[name]
            with deepspeed.zero.GatheredParameters([s], modifier_rank=None, enabled=hasattr(s, "ds_id")):
                p.copy_(s.data.reshape(p.shape))
        buffers = dict(source.named_buffers())
        for name, b in target.named_buffers():  # every one: a target made on the meta device holds no values
            b.copy_(buffers[name].reshape(b.shape))


def _sp_sum(x: float, sp: int, group) -> float:
    """Sum a number over the SP group; with sp 1 the group is None, which all_reduce reads as the whole world
    (the dp ranks, each on its own row): no collective then."""
    return x if sp == 1 else float(all_reduce(torch.tensor([x]), "sum", group).item())


def compare(model: nn.Module, mechanisms: ModelSetup | ParallelizeConfig, state: ParallelState,
            input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor, bf16: bool,
            pad_token_id: int = 0) -> VerifyResult:
    """Run `model` (a stock HF causal LM of its own, not trained afterwards) parallelized with `mechanisms` on
    this rank's shard of the row [1, n] (n a multiple of sp), then stock on the whole row; VerifySpError where
    they differ beyond the tolerances. Collective over the SP group. `model` is left unparallelized, with
    gradients."""
    tol_loss, tol_norm, tol_param = BF16_TOLERANCES if bf16 else FP32_TOLERANCES
    n = input_ids.shape[1]
    sp, group = state.sp_size, state.sp_group
    local = n // sp
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    watched = _watched(model)
    stock_types = {name: type(m).__name__ for name, m in model.named_modules()}

    # 1. parallelized: this rank's shard [1, n/sp]
    sp_model = parallelize(model, state, mechanisms)
    try:
        shard = shard_batch(input_ids, sp_size=sp, sp_rank=state.sp_rank, position_ids=position_ids, labels=labels,
                            pad_token_id=pad_token_id).to(input_ids.device)
        count = int(_sp_sum(float(shard.num_valid), sp, group))
        sp_out: dict[str, list[torch.Tensor]] = {}
        with _recording(sp_model.causal_lm, watched, sp_out):  # the first forward only (a recompute runs it again)
            local_sum = sp_model(**shard.model_inputs())
        (local_sum / count).backward()
        loss = _sp_sum(float(local_sum.detach()), sp, group) / count
    finally:
        model = unparallelize(sp_model)
    params = dict(model.named_parameters())
    if sp > 1:  # replicated weights: the full gradient is the sum over the SP ranks
        for name in trainable:  # every rank every parameter (an expert no token of a shard chose has none)
            p = params[name]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            sum_in_place(p.grad, group)
    sp_samples, sp_norms = _grads(model, trainable)
    model.zero_grad(set_to_none=True)

    # 2. stock, the whole row, one forward per packed document (no mask crosses documents), on SP rank 0 only (the
    # others would compute the same): its numbers go to the SP group's ranks with theirs
    ref = None
    if state.sp_rank == 0:
        ref = _stock(model, input_ids, labels, position_ids, watched, count, trainable)
    if sp > 1:
        mine = {"dp_rank": state.dp_rank, "sp_rank": state.sp_rank, "ref": ref, "out": sp_out}
        group_of = sorted((x for x in gather_objects(mine) if x["dp_rank"] == state.dp_rank),
                          key=lambda x: x["sp_rank"])
        ref, outs = group_of[0]["ref"], [x["out"] for x in group_of]
    else:
        outs = [sp_out]
    ref_loss, ref_samples, ref_norms, ref_out = ref

    # 3. compare: every rank the same numbers
    grad_norm = math.sqrt(sum(v * v for v in sp_norms.values()))
    ref_grad_norm = math.sqrt(sum(v * v for v in ref_norms.values()))
    param_err = {name: max(_rel(sp_samples[name], ref_samples[name]), _rel(sp_norms[name], ref_norms[name]))
                 for name in trainable}
    worst_param = max(param_err, key=param_err.get) if param_err else "-"
    result = VerifyResult(loss, ref_loss, grad_norm, ref_grad_norm, param_err.get(worst_param, 0.0), worst_param, n)
    loss_err, norm_err = _rel(loss, ref_loss), _rel(grad_norm, ref_grad_norm)
    whole = _rel(torch.cat([sp_samples[k] for k in trainable]), torch.cat([ref_samples[k] for k in trainable])) \
        if trainable else 0.0  # the sampled gradient as one vector: the exactness tolerance's measure
    if loss_err <= tol_loss and max(norm_err, whole if not bf16 else 0.0) <= tol_norm and result.worst <= tol_param:
        return result
    out_err = [_output_error(name, outs, ref_out, local, n) for name in watched]
    first = next((name for name, e in zip(watched, out_err) if e > tol_loss), None)
    if first is not None:
        where = f"the output of {stock_types[first]} ({first}) first differs ({max(out_err):.2e} at most)"
    else:  # the forward agrees: backward runs the modules in reverse, so the latest one with a wrong gradient
        ran = list(ref_out)  # the watched modules in the order the stock forward ran them
        bad = [name for name in trainable if param_err[name] > tol_param] or [worst_param]
        last = max(bad, key=lambda name: _forward_index(name, ran))
        where = f"the gradients of {_layer_type(model, last)} ({last}) first differ in backward"
    raise VerifySpError(
        f"verify_sp: the parallelized model differs from the stock transformers model on this run's model: loss "
        f"{loss:.8g} vs {ref_loss:.8g} (relative {loss_err:.2e}), grad norm {grad_norm:.8g} vs {ref_grad_norm:.8g} "
        f"(relative {norm_err:.2e}), sampled gradient relative {whole:.2e} ({worst_param}: {result.worst:.2e}); "
        f"{where}. This run would train that layer type wrongly; report it with the model's config, or set "
        f"verify_sp false to train anyway")


def _stock(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor,
           watched: list[str], count: int, trainable: list[str]
           ) -> tuple[float, dict[str, torch.Tensor], dict[str, float], dict[str, list[torch.Tensor]]]:
    """The stock model on the whole row [1, n]: (loss, gradient samples, gradient norms, projected outputs)."""
    n = input_ids.shape[1]
    shifted = torch.full_like(labels, IGNORE_INDEX)  # [1, n]: the next token, none across a document start
    shifted[:, :-1] = labels[:, 1:]
    shifted[:, :-1][position_ids[:, 1:] == 0] = IGNORE_INDEX
    starts = sorted(set([0] + (position_ids[0] == 0).nonzero().flatten().tolist())) + [n]
    spans = list(zip(starts[:-1], starts[1:]))
    if chooses_by_longest(model):  # LongRoPE, dynamic: the row's forward, its documents kept apart by position_ids
        spans = [(0, n)]  # (transformers' packed-sequence masks), picks the factors on the row as the trainer does
    ref_out: dict[str, list[torch.Tensor]] = {}
    total = torch.zeros((), dtype=torch.float32, device=input_ids.device)
    with _recording(model, watched, ref_out):
        for a, e in spans:
            logits = model(input_ids=input_ids[:, a:e], position_ids=position_ids[:, a:e]).logits.float()  # [1, e-a, V]
            total = total + F.cross_entropy(logits[0], shifted[0, a:e], ignore_index=IGNORE_INDEX, reduction="sum")
            del logits
    (total / count).backward()
    samples, norms = _grads(model, trainable)
    return float(total.detach()) / count, samples, norms, ref_out


def _output_error(name: str, outs: list[dict[str, list[torch.Tensor]]], ref_out: dict[str, list[torch.Tensor]],
                  local: int, n: int) -> float:
    """The relative difference of a module's projected outputs, every SP rank's slice against the stock row's
    (0 where the module ran more than once on a rank or its output is not [b, s, ...])."""
    ref = ref_out.get(name, [])
    if not ref or any(len(o.get(name, [])) != 1 for o in outs):
        return 0.0
    full = torch.cat(ref, dim=1) if len(ref) > 1 else ref[0]  # [b, n, PROJECTION]
    got = torch.cat([o[name][0] for o in outs], dim=1)  # the SP ranks' slices in rank order
    if full.shape[1] != n or got.shape != full.shape or any(o[name][0].shape[1] != local for o in outs):
        return 0.0
    return _rel(got, full)


def first_row_cut(row: dict, sp_size: int, pad_to_multiple_of: int | None, max_length: int,
                  max_tokens: int = MAX_TOKENS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(input_ids, labels, position_ids), each [1, n]: the row's first real tokens, at most `max_tokens`, n a
    multiple the sharding accepts; None for a row too short to shard. Labels with no target left train every
    token (the check is of the model, not of the masking)."""
    unit = padded_length(1, sp_size, pad_to_multiple_of)
    real = int(row.get("real_tokens", row["input_ids"].shape[-1]))
    n = min(real, max_length, max(max_tokens, unit)) // unit * unit
    if n < max(2, unit):
        return None
    ids = row["input_ids"].reshape(-1)[:n][None]
    pos = row["position_ids"].reshape(-1)[:n][None]
    labels = row.get("labels", row["input_ids"]).reshape(-1)[:n][None]
    if not bool((labels[:, 1:] != IGNORE_INDEX).any()):
        labels = ids
    return ids, labels, pos


def run_check(source: nn.Module, new_model: Callable[[], nn.Module], mechanisms: ModelSetup | ParallelizeConfig,
              state: ParallelState, row: dict, bf16: bool, pad_to_multiple_of: int | None, max_length: int,
              device: torch.device, pad_token_id: int = 0) -> VerifyResult | None:
    """The check on a fresh model holding `source`'s weights (the engine's, gathered), with every RNG state as
    it was afterwards. None when the row is too short to shard. Collective: every rank of the job calls it."""
    cut = first_row_cut(row, state.sp_size, pad_to_multiple_of, max_length,
                        MAX_TOKENS if device.type == "cuda" else MAX_TOKENS_CPU)
    if cut is None:
        return None
    t0 = time.perf_counter()
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):  # the run's dropout and data RNG stay as they were
        model = new_model()
        copy_weights(model, source)
        for m in model.modules():  # dropout (LoRA's) draws differently in the two runs: the check compares without
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        ids, labels, pos = (t.to(device) for t in cut)
        try:
            result = compare(model, mechanisms, state, ids, labels, pos, bf16, pad_token_id)
        finally:
            del model
            if cuda:
                torch.cuda.empty_cache()
    result.seconds = time.perf_counter() - t0
    return result
