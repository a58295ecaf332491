"""What the memory model hands back: its terms, the estimate they add up to, and that estimate's `plan --json` form."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..vocabulary.names import GIB
from .inputs import ModelShape, Settings

# `plan --json` keeps the keys it has always written for these Settings fields
_JSON_KEYS = {"optimizer_offload": "offload_optimizer", "attn_implementation": "attention",
              "keep_attention_outputs": "kept_attention_layers", "sp_size": "sp", "dp_size": "dp",
              "gpus_per_node": "gpus_per_host"}


@dataclass(frozen=True)
class Term:
    """One line of the estimate. phase: static / resident (alive across the step) / a transient phase /
    overhead; only the peak phase's transient terms count towards the GPU peak."""

    name: str
    gpu: int
    host: int
    phase: str
    detail: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU peak and per-host memory of one training step, term by term (bytes)."""

    shape: ModelShape
    settings: Settings
    terms: tuple[Term, ...]
    phases: dict[str, int]  # transient bytes of each phase
    peak_phase: str
    gpu_peak: int  # what torch.cuda.max_memory_allocated should read
    gpu_required: int  # peak + allocator slack + CUDA context: what must fit on the device
    host_per_rank: int
    host_per_host: int

    def term(self, name: str) -> Term:
        for t in self.terms:
            if t.name == name:
                return t
        raise KeyError(name)

    def counts(self, t: Term) -> bool:
        """Whether a term is part of the GPU peak."""
        return t.phase in ("static", "resident", "overhead") or t.phase == self.peak_phase

    def fits(self, gpu_memory_gb: float, host_memory_gb: float | None) -> bool:
        ok = self.gpu_required <= gpu_memory_gb * GIB
        return ok and (host_memory_gb is None or self.host_per_host <= host_memory_gb * GIB)

    def to_dict(self) -> dict[str, Any]:
        s = self.settings
        return {
            "settings": {_JSON_KEYS.get(k, k): v for k, v in s.flat().items() if k != "zero3"}
            | {"zero3": s.zero3.memory_sizes()},
            "local_tokens": s.local_tokens, "padded_length": s.padded_length,
            "parameters": self.shape.num_params,
            "terms": [{"name": t.name, "phase": t.phase, "gpu_gb": t.gpu / GIB, "host_gb": t.host / GIB,
                       "in_peak": self.counts(t), "detail_gb": {k: v / GIB for k, v in t.detail.items()}}
                      for t in self.terms],
            "phases_gb": {k: v / GIB for k, v in self.phases.items()},
            "peak_phase": self.peak_phase,
            "gpu_peak_gb": self.gpu_peak / GIB, "gpu_required_gb": self.gpu_required / GIB,
            "host_per_rank_gb": self.host_per_rank / GIB, "host_per_host_gb": self.host_per_host / GIB,
        }
