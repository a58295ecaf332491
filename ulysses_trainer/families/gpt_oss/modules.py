"""gpt-oss's torch side: its block runs as Qwen3-MoE's (levers/sparse_moe.SparseMoE under the router's own name),
returning the pair its decoder layer unpacks; its attention sinks need nothing installed (the Ulysses attention
takes them from the layer: parallel/ulysses.py). INSTALLS is what families/installs.load_modules registers."""

from __future__ import annotations

import functools

from torch import Tensor

from ...levers.sparse_moe import SparseMoE
from ..qwen3_moe.modules import install_sparse_moe
from . import GptOssMoeMlp


class GptOssSparseMoE(SparseMoE):
    """SparseMoE returning (hidden states, None): transformers' GptOssDecoderLayer unpacks the block's output as
    (hidden states, router scores) and drops the scores."""

    def forward(self, x: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return super().forward(x), None


INSTALLS = {GptOssMoeMlp: functools.partial(install_sparse_moe, moe_class=GptOssSparseMoE)}
