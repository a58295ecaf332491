"""Ulysses SP under a real DeepSpeed ZeRO-3 engine equals an unsharded plain-HF reference (fp32).

The reference shares no code with the SP path: stock HF Qwen3 with SDPA, full logits, one forward per
packed document, F.cross_entropy summed and divided by the token count.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_ranks

VOCAB = 503


def tiny_config(kv_heads=2):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=kv_heads, head_dim=16,
                       tie_word_embeddings=True, max_position_embeddings=4096, attn_implementation="sdpa")


def build_model(kv_heads=2):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(1234)
    return Qwen3ForCausalLM(tiny_config(kv_heads)).float()


def make_batch(n_seqs, length, doc_lengths=None, seed=0):
    """input_ids [n, L] and position_ids restarting at each document (global when doc_lengths None)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n_seqs, length), generator=g)
    if doc_lengths is None:
        pos = torch.arange(length).expand(n_seqs, length).clone()
    else:
        assert sum(doc_lengths) == length
        pos = torch.cat([torch.arange(n) for n in doc_lengths]).expand(n_seqs, length).clone()
    return ids, pos


def reference(ids, pos, kv_heads):
    """Plain HF, no SP: sum of per-document CE / number of targets, and all parameter grads."""
    model = build_model(kv_heads)
    total, count = 0.0, 0
    for row in range(ids.shape[0]):
        starts = (pos[row] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        for a, e in zip(starts[:-1], starts[1:]):
            doc = ids[row, a:e][None]
            logits = model(input_ids=doc).logits.float()
            total = total + F.cross_entropy(logits[0, :-1], doc[0, 1:], reduction="sum")
            count += e - a - 1
    loss = total / count
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return float(loss.detach()), grads


def _sp_rank(rank, world_size, sp_size, ids, pos, kv_heads, pad_to):
    from tests.dist_utils import sp_zero3_step
    from ulysses_trainer import ParallelizeConfig, make_parallel_state, parallelize  # the public API, as users call it

    state = make_parallel_state(sp_size)
    model = parallelize(build_model(kv_heads), state,
                        ParallelizeConfig(attn_implementation="sdpa", loss_chunk_size=7, tiled_mlp=False,
                                          gradient_checkpointing=False))
    row = state.dp_rank  # each dp rank trains its own sequence
    step = sp_zero3_step(model, state, ids[row:row + 1], position_ids=pos[row:row + 1], pad_to_multiple_of=pad_to,
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    shard = step["shard"]
    return {"loss": step["loss"], "grads": step["grads"], "tokens": step["tokens"], "shard_ids": shard.input_ids,
            "shard_labels": shard.labels, "shard_pos": shard.context.position_ids, "sp_rank": state.sp_rank,
            "dp_rank": state.dp_rank}


def check_against_reference(results, ids, pos, kv_heads, sp_size, pad_to=None):
    ref_loss, ref_grads = reference(ids, pos, kv_heads)
    n_targets = sum(int(((p[1:] != 0)).sum()) for p in pos)
    for r in results:
        assert r["tokens"] == n_targets
        assert abs(r["loss"] - ref_loss) / abs(ref_loss) <= 1e-5, (r["loss"], ref_loss)
        assert set(r["grads"]) == set(ref_grads), set(r["grads"]) ^ set(ref_grads)
        for name, g_ref in ref_grads.items():
            rel = (r["grads"][name] - g_ref).norm() / g_ref.norm()
            assert rel <= 1e-5, f"{name}: relative gradient error {rel:.2e}"
    # each rank holds exactly its slice of the padded sequence, with global positions
    from ulysses_trainer.vocabulary.layout import padded_length

    length = ids.shape[1]
    total = padded_length(length, sp_size, pad_to)
    local = total // sp_size
    for r in results:
        row, a = r["dp_rank"], r["sp_rank"] * local
        full = torch.cat([ids[row], torch.zeros(total - length, dtype=ids.dtype)])
        assert torch.equal(r["shard_ids"][0], full[a:a + local])
        real = min(local, max(0, length - a))
        assert torch.equal(r["shard_pos"][0, :real], pos[row, a:a + real])
        nxt = torch.cat([ids[row, 1:], torch.full((total - length + 1,), -100)])
        nxt_pos = torch.cat([pos[row, 1:], torch.ones(total - length + 1, dtype=pos.dtype)])
        expect = torch.where(nxt_pos == 0, torch.full_like(nxt, -100), nxt)
        assert torch.equal(r["shard_labels"][0], expect[a:a + local])


@pytest.mark.slow
def test_sp2_padded_and_packed():
    # 37 tokens: padded to 38 for sp=2; packed as three documents; kv heads 2 = sp (KV sharded)
    ids, pos = make_batch(1, 37, doc_lengths=[9, 16, 12])
    results = run_ranks(2, _sp_rank, 2, ids, pos, 2, None)
    check_against_reference(results, ids, pos, kv_heads=2, sp_size=2)


@pytest.mark.slow
def test_sp4_replicated_kv_heads_padded():
    # sp=4 > 2 KV heads: KV heads replicated; 37 tokens padded to 48 by pad_to_multiple_of=16
    ids, pos = make_batch(1, 37, seed=1)
    results = run_ranks(4, _sp_rank, 4, ids, pos, 2, 16)
    check_against_reference(results, ids, pos, kv_heads=2, sp_size=4, pad_to=16)


@pytest.mark.slow
def test_dp2_sp2_packed():
    # 4 ranks: two SP groups, each training its own (packed) sequence; gradients summed over dp
    ids, pos = make_batch(2, 41, doc_lengths=[20, 21], seed=2)
    results = run_ranks(4, _sp_rank, 2, ids, pos, 2, None)
    check_against_reference(results, ids, pos, kv_heads=2, sp_size=2)
