"""attention/length_tuned.py: a kernel whose autotuning is keyed by the token count registers a tuner for its shape
when it runs; the rehearsal's shorter warm-up then tunes it for the timed step's tokens (tests/test_rehearse.py)."""

import pytest
import torch

from ulysses_trainer.attention import length_tuned
from ulysses_trainer.families.qwen3_5 import deltanet_kernels as dk


def test_the_fla_rule_registers_its_l2norm_for_its_head_shape(monkeypatch):
    """The fla rule registers fla's q/k L2 norm once per (heads, head_dim, dtype, device) of q as it runs it; tuning
    runs the norm forward and backward over tokens x heads rows of that width (fla buckets its tuning by rows)."""
    monkeypatch.setattr(length_tuned, "_TUNERS", {})
    ran = []

    def rule(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel):
        assert use_qk_l2norm_in_kernel  # the norm the tuner stands for is the one inside the kernel
        return torch.zeros(v.shape), None

    def fwd(x):
        ran.append(("fwd", tuple(x.shape), x.dtype))
        return x, torch.ones(x.shape[:-1])

    def bwd(y, rstd, dy):
        ran.append(("bwd", tuple(y.shape), y.dtype))
        return dy

    names = {"chunk_gated_delta_rule": rule, "l2norm_fwd": fwd, "l2norm_bwd": bwd}
    monkeypatch.setattr(dk, "_fla", lambda module, name: names[name])
    monkeypatch.setattr(dk, "_fla_groups_values", lambda: True)
    q = torch.randn(1, 48, 2, 16)  # [b, t, key heads, head_dim]
    v, g, beta = torch.randn(1, 48, 4, 8), torch.randn(1, 48, 4), torch.rand(1, 48, 4)
    for _ in range(2):  # every layer runs it: one tuner per shape
        dk._fla_rule(q, q.clone(), v, g, beta, cu_seqlens=None)
    assert list(length_tuned._TUNERS) == [("fla q/k l2norm", 2, 16, torch.float32, q.device)]
    assert length_tuned.tune_for_tokens(1000) == ["fla q/k l2norm"]
    assert ran == [("fwd", (1000, 2, 16), torch.float32), ("bwd", (1000, 2, 16), torch.float32)]


@pytest.mark.parametrize("tokens", [0, -3, 2.5, True])
def test_a_token_count_that_is_not_a_positive_int_is_refused(tokens):
    with pytest.raises(ValueError, match="tokens must be an int >= 1"):
        length_tuned.tune_for_tokens(tokens)
