"""Evaluation's loss by position and recall probe (train/evaluation.py) against direct computations (CPU, fp32).

The reference shares no code with the sharded path: stock HF Qwen3 with SDPA, full logits, one forward per
document, F.cross_entropy per token and the label's rank among the logits, summed by bucket in float64.
The sharded side runs sp=1 and sp=2 (ranks as threads, the Ulysses all-to-alls for real)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.test_sp_exact import VOCAB, build_model, make_batch
from tests.threaded_ranks import run_threads
from ulysses_trainer.data.recall_probe import RecallProbe, build_recall_probe
from ulysses_trainer.data.sequences import SequenceDataset
from ulysses_trainer.levers.chunked_loss import chunked_bucket_sums
from ulysses_trainer.train.evaluation import evaluate, position_edges

IGNORE = -100


def test_position_edges_double_from_128_up_to_max_length():
    assert position_edges(1024) == [0, 128, 256, 512, 1024]
    assert position_edges(1000) == [0, 128, 256, 512, 1000]
    assert position_edges(100) == [0, 100]
    assert position_edges(1 << 20)[-3:] == [262144, 524288, 1 << 20]


@pytest.mark.parametrize("chunk", [7, 1000])
def test_bucket_sums_equal_the_full_logits(chunk):
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(2, 300, 24, generator=g), torch.randn(97, 24, generator=g) * 0.5
    y = torch.randint(0, 97, (2, 300), generator=g)
    y[torch.rand(2, 300, generator=g) < 0.2] = IGNORE
    y[0, :40] = IGNORE  # a whole chunk (of 7) without a label
    b = torch.randint(0, 5, (2, 300), generator=g)
    got = chunked_bucket_sums(h, w, y, b, 5, chunk)
    logits = (h @ w.t()).reshape(-1, 97)
    yf, bf = y.reshape(-1), b.reshape(-1)
    ok = yf != IGNORE
    nll = F.cross_entropy(logits[ok], yf[ok], reduction="none").double()
    hit = (logits[ok].argmax(-1) == yf[ok]).double()  # no ties in random fp32 logits
    for k in range(5):
        sel = bf[ok] == k
        assert abs(got[k, 0] - nll[sel].sum()) <= 1e-6 * nll[sel].sum()
        assert got[k, 1] == hit[sel].sum() and got[k, 2] == sel.sum()
    assert got[:, 1].sum() > 0  # some hits: the hit column is not trivially zero


def _rows(ids: torch.Tensor, pos: torch.Tensor) -> list[dict]:
    return [{"input_ids": ids[i], "position_ids": pos[i], "labels": ids[i], "real_tokens": ids.shape[1]}
            for i in range(ids.shape[0])]


def _sharded_evaluate(sp_size: int, rows: list[dict], max_length: int, probe: RecallProbe | None = None) -> list:
    """evaluate() on sp ranks (threads), one row per round, every rank's result."""
    from ulysses_trainer import ParallelizeConfig, make_parallel_state, parallelize, shard_batch

    models = [build_model() for _ in range(sp_size)]

    def rank(r: int, world_size: int):
        state = make_parallel_state(world_size)
        model = parallelize(models[r], state, ParallelizeConfig(attn_implementation="sdpa", loss_chunk_size=7,
                                                                tiled_mlp=False, gradient_checkpointing=False))

        def shard(batch: list[dict]):
            return shard_batch(torch.stack([b["input_ids"] for b in batch]),
                               position_ids=torch.stack([b["position_ids"] for b in batch]),
                               labels=torch.stack([b["labels"] for b in batch]), sp_size=state.sp_size,
                               sp_rank=state.sp_rank)

        return evaluate(model, rows, 1, max_length, state, shard, probe)

    return run_threads(sp_size, rank)


def _reference_by_position(ids: torch.Tensor, pos: torch.Tensor, edges: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(NLL sum, tokens) per bucket of the predicted token's position in its document, plain HF."""
    model = build_model()
    sums, counts = np.zeros(len(edges) - 1), np.zeros(len(edges) - 1, dtype=np.int64)
    with torch.no_grad():
        for row in range(ids.shape[0]):
            starts = (pos[row] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
            for a, e in zip(starts[:-1], starts[1:]):
                doc = ids[row, a:e]
                nll = F.cross_entropy(model(input_ids=doc[None]).logits[0, :-1].float(), doc[1:], reduction="none")
                where = np.searchsorted(edges[1:-1], np.arange(1, e - a), side="right")  # token t of the doc
                np.add.at(sums, where, nll.double().numpy())
                np.add.at(counts, where, 1)
    return sums, counts


@pytest.mark.parametrize("sp_size", [1, 2])
@pytest.mark.parametrize("docs", [None, [37, 263]], ids=["rows", "packed"])
def test_loss_by_position_equals_plain_hf_per_bucket(sp_size, docs):
    ids, pos = make_batch(2, 300, docs, seed=4)  # buckets [0,128) [128,256) [256,300)
    edges = position_edges(300)
    ref_sum, ref_tokens = _reference_by_position(ids, pos, edges)
    assert (ref_tokens > 0).all()  # every bucket holds targets (the packed rows' long document reaches 256)
    for res in _sharded_evaluate(sp_size, _rows(ids, pos), 300):  # every rank logs the same
        assert res.edges == edges and res.position_tokens == ref_tokens.tolist()
        for got, s, n in zip(res.position_loss, ref_sum, ref_tokens):
            assert abs(got - s / n) <= 1e-5 * abs(s / n), (got, s / n)
        assert abs(res.loss - ref_sum.sum() / ref_tokens.sum()) <= 1e-5 * res.loss


def _greedy(model, prefix: list[int], n: int) -> list[int]:
    out = list(prefix)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(prefix):]


def _probe_with_known_answers(length: int) -> tuple[RecallProbe, np.ndarray]:
    """A probe over random text whose even facts' answers are the model's own greedy tokens (recalled) and whose
    odd facts' answers are one token off the argmax at their last value token (not recalled)."""
    model = build_model()
    rng = np.random.default_rng(5)
    edges = position_edges(length)
    n_rows, per_row, n_val = 2, 3, 3
    tokens = rng.integers(0, VOCAB, (n_rows, length)).astype(np.int32)
    starts = np.array([[length - 40, length - 25, length - 10]] * n_rows)
    distance = np.array([[20, 150, 260], [100, 200, 60]])
    expected = np.zeros((n_rows, per_row), dtype=bool)
    for i in range(n_rows):
        for j, a in enumerate(starts[i]):
            value = _greedy(model, tokens[i, :a].tolist(), n_val)
            if j % 2:  # the last value token is not the argmax
                value[-1] = (value[-1] + 1) % VOCAB
            tokens[i, a:a + n_val] = value
            expected[i, j] = j % 2 == 0
    # a later fact's greedy value reads earlier facts' tokens: what the model predicts now is the truth
    with torch.no_grad():
        for i in range(n_rows):
            arg = model(input_ids=torch.tensor(tokens[i:i + 1], dtype=torch.long)).logits[0].argmax(-1).numpy()
            for j, a in enumerate(starts[i]):
                expected[i, j] = bool((arg[a - 1:a - 1 + n_val] == tokens[i, a:a + n_val]).all())
    probe = RecallProbe(tokens, starts, np.full((n_rows, per_row), n_val), distance, edges)
    return probe, expected


@pytest.mark.parametrize("sp_size", [1, 2])
def test_recall_probe_scores_the_teacher_forced_argmax(sp_size):
    probe, expected = _probe_with_known_answers(300)
    assert expected.any() and not expected.all()  # both outcomes occur: the score can be wrong
    acc, facts = probe.by_distance(expected, np.ones_like(expected))
    assert facts == [3, 2, 1]
    rows = [{"input_ids": torch.zeros(300, dtype=torch.long), "position_ids": torch.arange(300),
             "labels": torch.zeros(300, dtype=torch.long), "real_tokens": 300}] * 2
    for res in _sharded_evaluate(sp_size, rows, 300, probe):
        assert res.recall_facts == facts and res.recall_accuracy == acc
        assert res.recall == expected.mean()


def test_built_probe_states_each_fact_its_distance_before_its_answer():
    from ulysses_trainer.data.tokenizer import load_tokenizer

    encode = load_tokenizer(None).encode
    length = 1024
    g = np.random.default_rng(0)
    ds = SequenceDataset(g.integers(0, 1000, 3 * length).astype(np.int32), None, length, "test", 3, 3)
    edges = position_edges(length)
    probe = build_recall_probe(ds, edges, seed=7, encode=encode, num_rows=2)
    assert probe.tokens.shape == (2, length)
    for i in range(2):
        row = probe.row(i)
        labelled = (row["labels"] != IGNORE).nonzero().flatten()
        spans = [(a, n) for a, n in zip(probe.answer_start[i], probe.value_len[i]) if a >= 0]
        assert sorted(labelled.tolist()) == sorted(t for a, n in spans for t in range(a, a + n))
        for (a, n), d in zip(spans, probe.distance[i]):
            assert (probe.tokens[i, a:a + n] == probe.tokens[i, a - d:a - d + n]).all()  # the value, d before
        _, facts = probe.by_distance(np.zeros_like(probe.answer_start, dtype=bool), probe.answer_start >= 0)
        assert all(facts)  # every bucket holds facts
    assert not (probe.tokens[0] == probe.tokens[1]).all()
    # the same rows on every rank and every evaluation: they derive from the seed only
    again = build_recall_probe(ds, edges, seed=7, encode=encode, num_rows=2)
    assert (again.tokens == probe.tokens).all()


def test_a_row_too_short_for_one_fact_per_bucket_is_refused_naming_the_length_it_needs():
    from ulysses_trainer.data.tokenizer import load_tokenizer
    from ulysses_trainer.errors import ConfigError

    length = 128
    ds = SequenceDataset(np.zeros(2 * length, dtype=np.int32), None, length, "test", 2, 2)
    with pytest.raises(ConfigError, match=r"eval_recall_probe: .* raise max_length to at least \d+"):
        build_recall_probe(ds, position_edges(length), seed=0, encode=load_tokenizer(None).encode)
