"""The one row builder (data/rows.build_rows) pinned through the trainer's data entry (build_sequences) against a
small independent reference written here: joined text (packed or not, tail dropped or padded, capped reads), whole
examples one per row, next_fit and wrapped (rows, positions, labels, lengths, counts), and bfd by its invariants
(every example whole, once, at position 0; no more rows than best fit). Sources are local jsonl files and the
synthetic ones: no network."""

import json
import random

import numpy as np
import pytest

from ulysses_trainer.config import TrainConfig
from ulysses_trainer.data.documents import _open, build_sequences
from ulysses_trainer.data.formats import LANGUAGE_MODELING
from ulysses_trainer.data.qwen_bpe import QwenBPETokenizer
from ulysses_trainer.data.rows import build_rows, lower_bound
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.parallel.sharding import IGNORE_INDEX


@pytest.fixture(scope="module")
def tok():
    return QwenBPETokenizer()


def _texts(n: int, seed: int, hi: int) -> list[str]:
    rng = random.Random(seed)
    vocab = ["alpha", "beta", "gamma", "delta", "stone", "cloud", "seven", "red", "é", "東京"]
    return [" ".join(rng.choice(vocab) for _ in range(rng.randint(1, hi))) for _ in range(n)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("rows")
    t = _texts(24, 1, 90)
    t[3] = t[7] = ""  # empty documents (skipped, counted)
    t[11] = " ".join(["alpha"] * 300)  # longer than every max_length here
    c = _texts(48, 2, 40)
    chat = [{"messages": [{"role": "system", "content": c[3 * i]}, {"role": "user", "content": c[3 * i + 1]},
                          {"role": "assistant", "content": c[3 * i + 2]}]} for i in range(16)]
    chat[4]["messages"][2]["content"] = " ".join(["beta"] * 300)  # an example over max_length
    p = _texts(32, 3, 50)
    pc = [{"prompt": p[2 * i], "completion": p[2 * i + 1]} for i in range(16)]
    out = {}
    for name, rows in (("text", [{"text": x} for x in t] + [{"id": 1}]), ("chat", chat), ("pc", pc)):
        path = d / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out[name] = str(path)
        (d / f"{name}_eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[::-1]))
        out[name + "_eval"] = str(d / f"{name}_eval.jsonl")
    return out


def _cfg(files, src: str, split: str, **kw) -> TrainConfig:
    name = {"synthetic": None, "sessions": "synthetic:agent_sessions"}.get(src, files.get(src))
    if split == "eval" and src in ("text", "chat", "pc"):
        kw["eval_dataset_name"] = files[src + "_eval"]
    return TrainConfig(dataset_name=name, assistant_only_loss=kw.pop("aol", src == "sessions"), **kw)


def _source(cfg: TrainConfig, tok, split: str, n: int | None) -> tuple[bool, list[tuple[np.ndarray, np.ndarray]]]:
    """(text?, the source's examples as (ids, trained)) in order: each text document + eos, every token trained.
    A capped synthetic source is endless: enough examples for the rows are taken."""
    src = _open(cfg, tok, split, 1, n)
    text = src.kind == LANGUAGE_MODELING
    out, total = [], 0
    for item in src.items:
        ex = (np.asarray(tok.encode(item) + [tok.eos_token_id]), None) if text else item
        out.append((ex[0], np.ones(len(ex[0]), bool) if text else ex[1]))
        total += len(ex[0])
        if src.total is None and n is not None and total > 4 * (n + 1) * cfg.max_length and len(out) > 4 * (n + 1):
            break
    return text, out


def _target(trained: np.ndarray) -> np.ndarray:
    t = trained.copy()
    t[0] = False
    return t


def _reference(cfg: TrainConfig, text: bool, examples, n: int | None, pad: int):
    """Rows as lists: (ids, positions, trained, real) per row, and the counts that matter, from the settings alone."""
    L = cfg.max_length
    if text and not (cfg.packing and cfg.packing_strategy != "wrapped"):  # joined and cut
        stream, pos, used = [], [], 0
        for ids, _ in examples:
            stream += ids.tolist()
            pos += list(range(len(ids)))
            used += 1
            if n is not None and len(stream) >= n * L:
                break
        full = len(stream) // L if n is None else min(len(stream) // L, n)
        tail = len(stream) - full * L if (n is None or full < n) else 0
        rows = []
        for r in range(full + bool(tail and cfg.pad_last_sequence)):
            ids = stream[r * L:(r + 1) * L]
            p = pos[r * L:(r + 1) * L]
            real = len(ids)
            p += list(range(p[-1] + 1, p[-1] + 1 + L - real))
            ids += [pad] * (L - real)
            seg = [j == 0 or p[j] == 0 for j in range(L)]  # a row start or a document start
            q = []
            for j in range(L):
                q.append(0 if seg[j] else q[-1] + 1)
            rows.append((ids, q if cfg.packing else list(range(L)), [j < real for j in range(L)], real))
        counts = {"sequences": len(rows), "tokens": len(stream), "documents_used": used,
                  "tail_tokens": tail, "pad_tokens": L - tail if tail and cfg.pad_last_sequence else 0,
                  "tail": ("padded" if cfg.pad_last_sequence else "dropped") if tail else
                  ("not read" if n is not None and full == n else "none")}
        return rows, counts
    kept = []  # the examples the rows take: empty ones left out; too long ones truncated or dropped
    for ids, tr in examples:
        if len(ids) == 0 or (len(ids) > L and cfg.max_length_policy == "drop" and
                             not (cfg.packing and cfg.packing_strategy == "wrapped")):
            continue
        kept.append((ids, tr))
    rows, cur = [], []

    def close():
        ids = [int(x) for seg in cur for x in seg[0]]
        pos = [j for seg in cur for j in range(len(seg[0]))]
        trained = [bool(x) for seg in cur for x in _target(seg[1])]
        real = len(ids)
        pos += list(range(pos[-1] + 1, pos[-1] + 1 + L - real))
        rows.append((ids + [pad] * (L - real), pos if cfg.packing else list(range(L)),
                     trained + [False] * (L - real), real))
        cur.clear()

    if cfg.packing and cfg.packing_strategy == "wrapped":
        used = 0
        for ids, tr in kept:
            start = 0
            while start < len(ids) and (n is None or len(rows) < n):
                k = min(len(ids) - start, L - used)
                cur.append((ids[start:start + k], tr[start:start + k]))
                used, start = used + k, start + k
                if used == L:
                    close()
                    used = 0
            if n is not None and len(rows) >= n:
                break
    else:  # one per row, or next_fit
        used = 0
        for ids, tr in kept:
            ids, tr = ids[:L], tr[:L]
            if cur and (not cfg.packing or used + len(ids) > L):
                close()
                used = 0
                if n is not None and len(rows) >= n:
                    break
            cur.append((ids, tr))
            used += len(ids)
    if cur and (n is None or len(rows) < n):
        close()
    return rows, {"sequences": len(rows), "pad_tokens": sum(L - r[3] for r in rows)}


GRID = [(src, L, packing, strategy, pad_last, policy, n, split)
        for src in ("text", "chat", "pc")
        for L, n in ((37, None), (64, 3), (251, None), (64, 1))
        for packing, strategy in ((False, "bfd"), (True, "next_fit"), (True, "wrapped"), (True, "bfd"))
        for pad_last, policy in ((False, "truncate"), (True, "drop"))
        for split in ("train", "eval")
        if not (split == "eval" and L == 251)]
GRID += [(src, L, packing, strategy, pad_last, "truncate", 3, "train")
         for src in ("synthetic", "sessions") for L in (37, 64)
         for packing, strategy in ((False, "bfd"), (True, "next_fit"), (True, "wrapped"), (True, "bfd"))
         for pad_last in (False, True)]


@pytest.mark.parametrize("src,L,packing,strategy,pad_last,policy,n,split", GRID)
def test_rows_equal_the_reference(tok, files, src, L, packing, strategy, pad_last, policy, n, split):
    cfg = _cfg(files, src, split, max_length=L, packing=packing, packing_strategy=strategy,
               pad_last_sequence=pad_last, max_length_policy=policy)
    try:
        ds = build_sequences(cfg, tok, split, num_sequences=n)
    except ConfigError as e:  # no row: the reference makes none either (too few tokens, every example dropped)
        text, examples = _source(cfg, tok, split, n)
        kept = [i for i, _ in examples if len(i) and (policy == "truncate" or len(i) <= L)]
        assert "gives" in str(e) and (not kept if packing and strategy == "bfd" else
                                      _reference(cfg, text, examples, n, tok.eos_token_id)[0] == [])
        return
    text, examples = _source(cfg, tok, split, n)
    counts = ds.counts.to_dict()
    assert len(ds) == counts["sequences"] and ds.counts.max_length == L
    assert counts["documents_read"] == counts["documents_used"] + sum(counts["skipped"].values())
    if text and not (packing and strategy != "wrapped"):
        assert ds.trained is None and ds.lengths is None and not ds.counts.whole_examples
        assert (ds.positions is None) == (not packing)
    else:
        assert ds.trained is not None and ds.lengths is not None and ds.counts.whole_examples
    got = [ds[i] for i in range(len(ds))]
    if packing and strategy == "bfd":  # best fit: every kept example whole, once, at position 0; rows <= best fit
        segs = []
        for row in got:
            ids, pos = row["input_ids"].tolist(), row["position_ids"].tolist()
            starts = [j for j in range(row["real_tokens"]) if pos[j] == 0] + [row["real_tokens"]]
            segs += [tuple(ids[a:b]) for a, b in zip(starts, starts[1:])]
            assert row["real_tokens"] <= L and all(x == IGNORE_INDEX for x in row["labels"][row["real_tokens"]:])
        kept = [tuple(i[:L].tolist()) for i, _ in examples if len(i) and (policy == "truncate" or len(i) <= L)]
        if n is None:
            assert sorted(segs) == sorted(kept)
            assert lower_bound([len(s) for s in kept], L) <= len(got)
        else:
            assert set(segs) <= set(kept) and (len(got) == n or sorted(segs) == sorted(kept))
        assert counts["pad_tokens"] == sum(L - r["real_tokens"] for r in got)
        return
    want, want_counts = _reference(cfg, text, examples, n, tok.eos_token_id)
    assert len(got) == len(want)
    for row, (ids, pos, trained, real) in zip(got, want):
        assert row["input_ids"].tolist() == ids
        assert row["position_ids"].tolist() == pos
        labels = [x if t else IGNORE_INDEX for x, t in zip(ids, trained)]
        if not ds.counts.whole_examples:  # joined text: every real token is its own label
            labels = [x if j < real else IGNORE_INDEX for j, x in enumerate(ids)]
        assert row["labels"].tolist() == labels
        assert row["real_tokens"] == real
    for k, v in want_counts.items():
        assert counts[k] == v, k


def test_one_builder_takes_the_tail_policy_and_the_strategy_explicitly():
    """joined: the tail dropped or padded; other strategies pad every row (a dropped tail is refused there)."""
    ex = [(np.arange(1, 8, dtype=np.int32), np.ones(7, bool)), (np.arange(10, 16, dtype=np.int32), np.ones(6, bool))]
    dropped = build_rows(iter(ex), 5, True, "truncate", 0, strategy="joined", tail="drop")
    assert dropped.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 10, 11, 12] and dropped.trained is None
    assert dropped.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 0, 1, 2] and dropped.counts.tail == "dropped"
    padded = build_rows(iter(ex), 5, False, "truncate", 0, strategy="joined", tail="pad")
    assert padded.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15, 0, 0] and padded.pad_from == 13
    assert padded.positions is None and padded.counts.pad_tokens == 2 and padded.counts.tail == "padded"
    wrapped = build_rows(iter(ex), 5, True, "truncate", 0, strategy="wrapped")
    assert wrapped.tokens.tolist() == padded.tokens.tolist() and wrapped.lengths.tolist() == [5, 5, 3]
    assert wrapped.trained.tolist()[:7] == [False, True, True, True, True, False, True]  # a segment's first: no
    with pytest.raises(ValueError, match="tail"):
        build_rows(iter(ex), 5, True, "truncate", 0, strategy="wrapped", tail="drop")
