"""Activation checkpointing of decoder layers, with each layer's saved input optionally on the host.

Checkpointed, a decoder layer keeps only its input hidden states [b, s, h] for backward and
recomputes the rest. At long sequence lengths those inputs, one per layer, are what is left of the
activation memory; offloading them to pinned host memory frees the device for longer sequences.

- Which layers offload is the plan's decision (plan/resolve.py): the earliest ones, whose backward runs
  last, so the host->device prefetch has the most time; the later layers stay on the device.
- `HostPool` (levers/host_pool.py) is one page-locked host buffer carved into per-layer slots.
- `LayerRecompute.for_layer(i)` is the function that a Hugging Face decoder layer
  (transformers' GradientCheckpointingLayer) calls as `_gradient_checkpointing_func(run_fn, hidden)`.

Copies run on a side CUDA stream, never on the compute stream: device->host in forward, overlapped
with the next layers; host->device in backward, one layer ahead of the layer being recomputed.
On CPU there are no streams and the "host" copy is a plain copy, so CPU tests exercise the logic.

`checkpoint_every=k` keeps the input of every k-th layer only (the block starts 0, k, 2k, ...); the
backward of a block's top layer rebuilds the inputs of the layers between by re-running their
forward, without a graph, from the block start: k-1 of every k layers run forward once more, and
the device holds N/k checkpoints plus at most k-1 rebuilt inputs instead of N. Offload applies to
the block starts. Collective invariant: every rank rebuilds the same layers in the same order (the
layout depends on N and k only), or the all-gathers of ZeRO-3 and the all-to-alls of SP deadlock.

Recompute is reentrant style, like torch.utils.checkpoint(use_reentrant=True): backward calls the
layer's forward again, so DeepSpeed ZeRO-3 re-gathers the sub-modules' parameters through its
module hooks, exactly as it does for reentrant checkpointing. No RNG state is replayed: Qwen3's
decoder layers have no dropout, so the recompute is deterministic without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..errors import ConfigError
from ..parallel.sharding import ShardContext, shard_in_scope, shard_scope
from .host_pool import HostPool

CheckpointFn = Callable[..., Any]


# --------------------------------------------------------------------------------------------
# Checkpointing


def _first(out: Any) -> tuple[Tensor, tuple | None]:
    # HF 5.x decoder layers return the hidden states; older ones a tuple led by them.
    if isinstance(out, Tensor):
        return out, None
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0], tuple(out[1:])
    raise TypeError(f"checkpointed layer must return a tensor or a tuple led by one, got {type(out)}")


def _autocast_state(device_type: str) -> list[tuple[str, bool, torch.dtype]]:
    # Recompute under the same autocast as forward, on the input's device and on the CPU.
    types = [device_type] if device_type == "cpu" else [device_type, "cpu"]
    return [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types]


ForwardState = tuple[list[tuple[str, bool, torch.dtype]], ShardContext | None]  # autocast, the shard in scope


def _forward_state(device_type: str) -> ForwardState:
    """What a recompute replays of its forward's surroundings: the autocast, and the shard in scope (the pads the
    tiled MLP leaves out: parallel/sharding.shard_scope)."""
    return _autocast_state(device_type), shard_in_scope()


class _AsInForward:
    """Enter a forward's autocast contexts and its shard's scope (parallel/sharding.shard_scope) as one."""

    def __init__(self, state: ForwardState, mlp_output_unused: bool = False) -> None:
        autocast, shard = state
        self.contexts = [torch.autocast(t, dtype=d, enabled=e) for t, e, d in autocast]
        self.contexts.append(shard_scope(shard, mlp_output_unused))

    def __enter__(self) -> None:
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for c in reversed(self.contexts):
            c.__exit__(*exc)


@dataclass
class _OffloadState:
    """One offloaded layer: its host slot as the input's shape, and the copies in flight."""

    generation: int = 0  # forwards so far; ties the slot's contents to one autograd node
    host: Tensor | None = None  # slot view, input dtype and shape
    device: torch.device | None = None
    copy_event: Any = None  # device->host copy done (CUDA event), for tests and inspection
    prefetch: tuple[int, Tensor, Any] | None = None  # (generation, device tensor, copy-done event)


class _Holder:
    """Carries the non-hidden outputs of a tuple-returning layer out of the Function."""

    rest: tuple | None = None


class _CheckpointFunction(torch.autograd.Function):
    """Forward without a graph, saving only the layer input (device or host); backward recomputes."""

    @staticmethod
    def forward(ctx, ckpt: LayerRecompute, layer: int, run_fn: Callable, holder: _Holder,
                _anchor: Tensor, hidden: Tensor, *args: Any) -> Tensor:
        ctx.ckpt, ctx.layer, ctx.run_fn, ctx.args = ckpt, layer, run_fn, args
        ctx.replay = _forward_state(hidden.device.type)
        with torch.no_grad():
            out, holder.rest = _first(run_fn(hidden, *args))
        ckpt.forward_calls[layer] += 1
        ctx.forward_call = ckpt.forward_calls[layer]
        if layer in ckpt._states:
            ctx.generation = ckpt._offload(layer, hidden)
        elif not ckpt.rebuilds(layer):
            ctx.save_for_backward(hidden)
            if ckpt.every > 1:  # the rebuilds of its block start from it
                ckpt._block_inputs[layer] = hidden
        if ckpt.every > 1:
            ckpt._runs[layer] = (ctx.forward_call, run_fn, args, ctx.replay)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        ckpt: LayerRecompute = ctx.ckpt
        ckpt._tell(ctx.layer, "checkpoint recompute")
        if ctx.layer in ckpt._states:
            x = ckpt._take_input(ctx.layer, ctx.generation)
        elif ckpt.rebuilds(ctx.layer):
            x = ckpt._rebuilt_input(ctx.layer, ctx.forward_call)
        else:
            (x,) = ctx.saved_tensors
            ckpt._prefetch(ckpt.block_start(ctx.layer - 1))
        ckpt._block_inputs.pop(ctx.layer, None)  # no rebuild below this layer starts from it any more
        ckpt._runs.pop(ctx.layer, None)
        x = x.detach().requires_grad_(ctx.needs_input_grad[5])
        args = [a.detach().requires_grad_(True) if isinstance(a, Tensor) and a.requires_grad else a
                for a in ctx.args]
        with torch.enable_grad():
            with _AsInForward(ctx.replay, ckpt.recompute_skips_mlp):
                out, _ = _first(ctx.run_fn(x, *args))
            ckpt._tell(ctx.layer, "backward")
            if out.requires_grad:
                # Accumulates the layer's parameter gradients and fills x.grad (and ZeRO-3's hooks run).
                torch.autograd.backward(out, grad_out)
        ckpt.recompute_calls[ctx.layer] += 1
        arg_grads = tuple(a.grad if isinstance(a, Tensor) and a.requires_grad else None for a in args)
        return (None, None, None, None, None, x.grad if x.requires_grad else None, *arg_grads)


class LayerRecompute:
    """Checkpoint functions for the decoder layers; the offload_layers keep their input on the host.

    Wiring, per decoder layer i::

        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = checkpointer.for_layer(i)

    One forward may be in flight per layer: a layer's host slot holds the input of its latest
    forward, so backward must run before that layer's next forward (a skipped backward is fine;
    two forwards followed by two backwards raise).
    """

    def __init__(self, num_layers: int, offload_layers: Iterable[int] = (), pool: HostPool | None = None,
                 checkpoint_every: int = 1, recompute_skips_mlp: bool = False):
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
            raise ConfigError(f"num_layers must be an int >= 0, got {num_layers!r}")
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1:
            raise ConfigError(f"checkpoint_every must be an int >= 1 (1 = every layer), got {checkpoint_every!r}")
        self.every = checkpoint_every
        self.saved_layers = list(range(0, num_layers, checkpoint_every))  # the block starts
        self._block_inputs: dict[int, Tensor] = {}  # device-resident block-start inputs, until their backward
        # layer -> (forward call, run_fn, args, what its recompute replays)
        self._runs: dict[int, tuple[int, Callable, tuple, ForwardState]] = {}
        self._rebuilt: dict[int, tuple[int, Tensor]] = {}  # layer -> (forward call, rebuilt input)
        self.rebuild_forwards = 0  # layer forwards run to rebuild inputs (not counting recomputes)
        layers = sorted(set(offload_layers))
        bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers]
        if bad:
            raise ConfigError(f"offload layer indices {bad} are outside 0..{num_layers - 1}")
        self.num_layers = num_layers
        self._check_block_starts(layers)
        self.offload_layers = layers
        self.pool = pool if pool is not None or not layers else HostPool()
        self._slot = {layer: k for k, layer in enumerate(layers)}
        self._states = {layer: _OffloadState() for layer in layers}
        self.forward_calls = [0] * num_layers
        self.recompute_calls = [0] * num_layers
        self.sync_fetches = 0  # host->device copies started when the layer's backward needed them
        self.prefetches = 0  # host->device copies started one layer ahead
        self._side_stream: Any = None
        # A leaf that needs grad, passed to every call: backward then runs (and parameter gradients
        # accumulate) even when the hidden states themselves need no grad, e.g. frozen embeddings.
        self._anchor = torch.empty(0, requires_grad=True)
        # a layer's recompute (not a rebuild, whose output is used) tells its tiled MLP that its output goes
        # unread: the MLP skips its forward (parallelize sets it where the family allows)
        self.recompute_skips_mlp = recompute_skips_mlp
        # told (layer, "checkpoint recompute" | "backward") as backward reaches each layer: an out-of-memory error
        # names where it happened (train/out_of_memory.Where); the layer hooks run outside the checkpoint
        self.observer: Callable[[int, str], None] | None = None

    def _tell(self, layer: int, stage: str) -> None:
        if self.observer is not None:
            self.observer(layer, stage)

    def set_offload_layers(self, offload_layers: Iterable[int]) -> None:
        """Choose the offloaded layers once the free device memory is known (before the first step)."""
        layers = sorted(set(offload_layers))
        bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"offload layer indices {bad} are outside 0..{self.num_layers - 1}")
        self._check_block_starts(layers)
        self.offload_layers = layers
        if self.pool is None and layers:
            self.pool = HostPool()
        self._slot = {layer: k for k, layer in enumerate(layers)}
        self._states = {layer: _OffloadState() for layer in layers}

    def configure(self, checkpoint_every: int, offload_layers: Iterable[int]) -> None:
        """Set the thinning and the offloaded layers (model/parallelize.apply, before the first step)."""
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be an int >= 1 (1 = every layer), got {checkpoint_every!r}")
        self.every = checkpoint_every
        self.saved_layers = list(range(0, self.num_layers, checkpoint_every))
        self.set_offload_layers(offload_layers)

    def rebuilds(self, layer: int) -> bool:
        """True if `layer` keeps no input: backward rebuilds it from its block start."""
        return layer % self.every != 0

    def block_start(self, layer: int) -> int:
        """The saved layer whose input starts `layer`'s block."""
        return layer - layer % self.every

    def _check_block_starts(self, layers: list[int]) -> None:
        bad = [i for i in layers if self.rebuilds(i)]
        if bad:
            raise ConfigError(f"offload layers {bad} keep no input with checkpoint_every={self.every}; offload "
                              f"block starts only ({self.saved_layers[:4]}...)")

    def _rebuilt_input(self, layer: int, forward_call: int) -> Tensor:
        """`layer`'s input for its backward: rebuilt earlier in this block's backward, or now."""
        got = self._rebuilt.pop(layer, None)
        if got is not None and got[0] == forward_call:
            return got[1]
        run = self._runs.get(layer)
        if run is None or run[0] != forward_call:
            raise RuntimeError(f"layer {layer} ran forward again before its backward; with checkpoint_every > 1 "
                               "run each backward before the next forward")
        b = self.block_start(layer)
        if b in self._states:
            st = self._states[b]
            self._prefetch(b)  # layer b's own backward takes this copy later
            assert st.prefetch is not None
            x, event = st.prefetch[1], st.prefetch[2]
            if event is not None:
                torch.cuda.current_stream(x.device).wait_event(event)
        else:
            x = self._block_inputs.get(b)
            if x is None:
                raise RuntimeError(f"layer {layer}'s block start {b} holds no input: run each backward before "
                                   "the next forward with checkpoint_every > 1")
        # Layers b .. layer-1 forward again, no graph: their outputs are the inputs of b+1 .. layer.
        for i in range(b, layer):
            self._tell(i, "checkpoint recompute")
            _, run_fn, args, replay = self._runs[i]
            with torch.no_grad(), _AsInForward(replay):
                x, _ = _first(run_fn(x, *args))
            self.rebuild_forwards += 1
            if i + 1 < layer:
                self._rebuilt[i + 1] = (self._runs[i + 1][0], x)
        self._tell(layer, "checkpoint recompute")  # the rebuilds done: the layer's own recompute
        return x

    def for_layer(self, i: int) -> CheckpointFn:
        """The `_gradient_checkpointing_func` for decoder layer i: fn(run_fn, hidden, *args)."""
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} out of range 0..{self.num_layers - 1}")

        def checkpoint(run_fn: Callable, hidden: Tensor, *args: Any) -> Any:
            if not torch.is_grad_enabled():  # no backward will come: nothing to save
                return run_fn(hidden, *args)
            holder = _Holder()
            out = _CheckpointFunction.apply(self, i, run_fn, holder, self._anchor, hidden, *args)
            return out if holder.rest is None else (out, *holder.rest)

        return checkpoint

    def state(self, layer: int) -> _OffloadState:
        """The offload state of an offloaded layer (its slot view and copy events), for inspection."""
        return self._states[layer]

    @property
    def side_stream(self) -> Any:
        """The CUDA stream that carries the offload copies (None before the first CUDA copy)."""
        return self._side_stream

    # -- copies ---------------------------------------------------------------------------

    def _side(self, device: torch.device) -> Any:
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=device)
        return self._side_stream

    def _offload(self, layer: int, hidden: Tensor) -> int:
        """Start the copy of layer's input into its host slot; return the slot's new generation."""
        st = self._states[layer]
        st.generation += 1
        st.prefetch = None  # left over from a backward that never ran
        nbytes = hidden.numel() * hidden.element_size()
        pool = self.pool
        if pool.buffer is None:
            pool.allocate(nbytes, len(self.offload_layers), pin=hidden.is_cuda)
        elif nbytes > pool.slot_bytes or len(self.offload_layers) > pool.num_slots:
            pool.allocate(nbytes, len(self.offload_layers))  # raises with the sizes
        st.host = pool.slot(self._slot[layer])[:nbytes].view(hidden.dtype).view(hidden.shape)
        st.device = hidden.device
        src = hidden.contiguous()
        if hidden.is_cuda:
            side = self._side(hidden.device)
            side.wait_stream(torch.cuda.current_stream(hidden.device))  # src is written on the compute stream
            with torch.cuda.stream(side):
                st.host.copy_(src, non_blocking=True)
                st.copy_event = side.record_event()
            # The compute stream may free src as soon as this returns; the allocator must not reuse
            # its memory until the side stream's copy is done.
            src.record_stream(side)
        else:
            st.host.copy_(src)
        return st.generation

    def _fetch(self, layer: int) -> tuple[Tensor, Any]:
        """Start the host->device copy of layer's input; return the tensor and its copy-done event."""
        st = self._states[layer]
        assert st.host is not None and st.device is not None
        if st.device.type != "cuda":
            return st.host.to(st.device, copy=True), None
        compute = torch.cuda.current_stream(st.device)
        side = self._side(st.device)
        # Allocated from the compute stream's pool, where it is used and freed.
        x = torch.empty(st.host.shape, dtype=st.host.dtype, device=st.device)
        # The block may have just been freed by compute work still queued: copy only after it.
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            x.copy_(st.host, non_blocking=True)
            event = side.record_event()
        x.record_stream(side)  # x may be dropped before the copy ends (backward abandoned)
        return x, event

    def _prefetch(self, layer: int) -> None:
        """Start fetching layer's input ahead of its backward, if it is offloaded and not yet fetched."""
        st = self._states.get(layer)
        if st is None or st.host is None or (st.prefetch is not None and st.prefetch[0] == st.generation):
            return
        x, event = self._fetch(layer)
        st.prefetch = (st.generation, x, event)
        self.prefetches += 1

    def _take_input(self, layer: int, generation: int) -> Tensor:
        """Layer's input on the device for its backward, ordered on the compute stream; prefetch the next."""
        st = self._states[layer]
        if st.generation != generation:
            raise RuntimeError(
                f"layer {layer}'s offloaded input was overwritten by a later forward before this backward "
                f"ran; with activation offload, run each backward before the next forward")
        pf, st.prefetch = st.prefetch, None
        if pf is not None and pf[0] == generation:
            _, x, event = pf
        else:
            x, event = self._fetch(layer)
            self.sync_fetches += 1
        if event is not None:
            torch.cuda.current_stream(x.device).wait_event(event)
        self._prefetch(self.block_start(layer - 1))  # the next input backward needs, while this one recomputes
        return x

