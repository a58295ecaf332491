"""Per-layer times of one train step (`ulysses-trainer rehearse --layer_times`): where a step's seconds go,
layer by layer, without a profiler's overhead or its trace files.

Marks are CUDA events on the compute stream (wall-clock on CPU), recorded where the trainer already tells
where it is: the decoder layers' forward hooks (a layer's first start and first end in the step: transformers
5.17 runs them inside the checkpoint, so they fire again in the recompute and the rebuilds) and the
checkpointer's observer (levers/recompute.py: "checkpoint recompute" as a layer's backward starts, or a rebuild
runs; "backward" once its recompute is done). Per layer, its backward is the span from the first mark after the
layer above's "backward" mark to the first mark after its own: the input fetch, the rebuilds and the recompute,
then the backward. The bottom layer's backward has no mark after it, so its span runs to the step's end and
takes the embedding's backward and the optimizer step with it (`last_backward_and_update_s`). One micro-batch
a step: with gradient accumulation the spans would cross micro-batches (rehearse refuses the two together).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

BACKWARD = "backward"  # the checkpointer's mark once a layer's recompute is done


class _Mark:
    """A point in the step: a CUDA event on the current stream, or the wall clock on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        if self.event is not None:
            self.event.record()
        self.t = time.perf_counter()

    def seconds_to(self, later: _Mark) -> float:
        if self.event is not None:
            return self.event.elapsed_time(later.event) / 1000.0  # ms -> s; both recorded on one stream
        return later.t - self.t

    def host_seconds_to(self, later: _Mark) -> float:
        """The host's clock between the two marks: where it matches the device's span, the device waited on the
        host (a host-side stall); where it is far shorter, the host ran ahead queueing work."""
        return later.t - self.t


class LayerTimes:
    """Marks one step's layers while entered; `result()` after the step's device work is done (synchronize)."""

    def __init__(self, layers: list[nn.Module], checkpointer: Any = None, cuda: bool = False) -> None:
        self.layers, self.checkpointer, self.cuda = layers, checkpointer, cuda
        self.forward: dict[int, list[_Mark]] = {}  # layer -> [start, end]
        self.marks: list[tuple[int, str, _Mark]] = []  # the checkpointer's, in order
        self._handles: list[Any] = []
        self._observer: Any = None
        self.start = self.end = None

    def __enter__(self) -> LayerTimes:
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._pre(i)))
            self._handles.append(layer.register_forward_hook(self._post(i)))
        if self.checkpointer is not None:  # chained: the out-of-memory report keeps its observer
            self._observer = self.checkpointer.observer
            self.checkpointer.observer = self._observe
        self.start = _Mark(self.cuda)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.end = _Mark(self.cuda)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.checkpointer is not None:
            self.checkpointer.observer = self._observer

    def _pre(self, i: int):
        def hook(module, args):
            if not self.marks and i not in self.forward:  # the forward's own start, not a recompute's or a nested call
                self.forward[i] = [_Mark(self.cuda)]
        return hook

    def _post(self, i: int):
        def hook(module, args, output):
            if not self.marks and len(self.forward.get(i, ())) == 1:  # the forward's first end
                self.forward[i].append(_Mark(self.cuda))
        return hook

    def _observe(self, layer: int, stage: str) -> None:
        if self._observer is not None:
            self._observer(layer, stage)
        self.marks.append((layer, stage, _Mark(self.cuda)))

    def result(self) -> dict[str, Any]:
        """Seconds by layer and around them (call after torch.cuda.synchronize()); on a GPU, `host` holds the same
        spans on the host's clock."""
        r = self._spans(lambda a, b: a.seconds_to(b))
        if self.cuda:
            r["host"] = self._spans(lambda a, b: a.host_seconds_to(b))
        return r

    def _spans(self, dt: Any) -> dict[str, Any]:
        n = len(self.layers)
        fwd = [dt(self.forward[i][0], self.forward[i][-1]) if len(self.forward.get(i, [])) == 2 else None
               for i in range(n)]
        recompute: list[float | None] = [None] * n
        backward: list[float | None] = [None] * n
        last = None  # the bottom layer's backward: to the step's end
        done = [k for k, (_, stage, _) in enumerate(self.marks) if stage == BACKWARD]
        for j, k in enumerate(done):
            layer, _, mark = self.marks[k]
            start = self.marks[done[j - 1] + 1][2] if j else self.marks[0][2]
            recompute[layer] = dt(start, mark)
            if k + 1 < len(self.marks):
                backward[layer] = dt(mark, self.marks[k + 1][2])
            else:
                last = dt(mark, self.end)
        first_fwd, last_fwd = self.forward.get(0), self.forward.get(n - 1)
        step = dt(self.start, self.end)
        before = dt(self.start, first_fwd[0]) if first_fwd else None
        loss = dt(last_fwd[-1], self.marks[0][2]) if last_fwd and self.marks else None
        spans = [before, *fwd, loss, *recompute, *backward, last]
        return {
            "step_s": step,
            "before_layers_s": before,  # embedding, gathers
            "forward_s": fwd,
            # the final norm and the loss head, forward and backward: from the top layer's forward to its backward
            "loss_s": loss,
            "recompute_s": recompute,  # a layer's backward until its recompute is done (fetch, rebuilds, forward)
            "backward_s": backward,  # from there to the next layer's backward (None: the bottom layer, below)
            "last_backward_and_update_s": last,
            # the step less every span above: the gaps between one layer's forward and the next's (small), or marks
            # that never came (then a span above is None)
            "unaccounted_s": step - sum(x for x in spans if x is not None),
        }


def summary(r: dict[str, Any]) -> str:
    """One line: the sums and each per-layer list's range."""
    def span(xs: list[float | None]) -> str:
        v = [x for x in xs if x is not None]
        return f"{sum(v):.2f} s ({min(v):.3f}-{max(v):.3f} a layer)" if v else "n/a"

    def s(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f} s"

    return (f"layer times of the last step ({r['step_s']:.2f} s): before the layers {s(r['before_layers_s'])}, "
            f"forward {span(r['forward_s'])}, loss {s(r['loss_s'])}, recompute {span(r['recompute_s'])}, "
            f"backward {span(r['backward_s'])}, the bottom layer's backward + the update "
            f"{s(r['last_backward_and_update_s'])}, unaccounted {s(r.get('unaccounted_s'))}")
