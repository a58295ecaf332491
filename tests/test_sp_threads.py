"""sp=2 in the fast tier: two ranks as threads (tests/threaded_ranks.py) run the Ulysses all-to-alls for real;
loss and gradients equal the unsharded plain-HF reference of tests/test_sp_exact.py (fp32, CPU)."""

import pytest
import torch

from tests.sp_rank import sp_steps, summed_grads
from tests.test_sp_exact import build_model, make_batch, reference


@pytest.mark.parametrize("kv_heads, docs", [(2, None), (1, [9, 14, 6])])  # kv 1: each KV head copied to both ranks
def test_sp2_threads_equal_the_unsharded_reference(kv_heads, docs):
    ids, pos = make_batch(2, 29, docs, seed=3)  # odd length: one pad on the last shard
    ref_loss, ref_grads = reference(ids, pos, kv_heads)
    models = [build_model(kv_heads) for _ in range(2)]  # built here: the seed is process-wide
    out = sp_steps(models, ids, pos, loss_chunk_size=7)
    for step in out:
        assert abs(step.loss - ref_loss) / abs(ref_loss) <= 1e-5
    grads = summed_grads(out)
    for name, ref in ref_grads.items():
        assert torch.linalg.norm(grads[name] - ref) / torch.linalg.norm(ref) <= 1e-5, name
