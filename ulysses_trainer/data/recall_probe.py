"""The recall probe's rows (eval_recall_probe): facts stated early in an eval row and asked for at its end.

One probe row per eval row, max_length tokens, one document (position_ids 0..L-1). Its text is the eval row's
own (its real tokens, continued by the next rows' where it is short: the haystack), with facts of the synthetic
documents' kind inserted ("The code of Velmora is 4821.", data/synthetic.py) and, at the end, the questions
("Question: what is the code of Velmora? Answer: 4821."), the nearest fact's first. Each fact is placed so that
the distance from its value to its answer (in tokens, first value token to first value token) falls in one of
the position buckets the eval reports, FACTS_PER_BUCKET facts per bucket where the row has room (the facts and
questions take at most a 1/TAIL_SHARE of it); the distance recorded is the one the row holds.

Only the answers' value tokens are labelled. The score is teacher-forced: a fact is recalled when each of its
value tokens (" 4821": the space and the digits) is an argmax of the model's prediction given the true tokens
before it, which one forward of the row measures (train/evaluation.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ConfigError
from ..parallel.sharding import IGNORE_INDEX
from .synthetic import fact_question, fact_statement, new_facts

FACTS_PER_BUCKET = 4  # facts whose distance aims at each bucket (fewer where the row has no room)
TAIL_SHARE = 3  # the facts and questions take at most 1/TAIL_SHARE of a row
HEADER = "\n\nRecall.\n"  # opens the questions, as the synthetic documents' recall block
_SEED = "recall-probe"  # the facts of row i derive from (seed, i) only: the same on every rank and every eval


@dataclass
class _Fact:
    statement: list[int]  # "\nThe code of Velmora is 4821.\n" as tokens
    value_at: int  # index of the value's first token in `statement`
    question: list[int]  # "Question: what is the code of Velmora? Answer: 4821.\n"
    answer_at: int  # index of the value's first token in `question`
    value_len: int
    target: float  # the distance aimed at


@dataclass
class RecallProbe:
    """The probe rows and where their facts are. Row i: `tokens[i]`; its fact j's answer value tokens start at
    `answer_start[i, j]` (-1: no fact j in that row), `value_len[i, j]` tokens, `distance[i, j]` tokens after
    the fact's value."""

    tokens: np.ndarray  # int32 [rows, L]
    answer_start: np.ndarray  # int64 [rows, K]
    value_len: np.ndarray  # int64 [rows, K]
    distance: np.ndarray  # int64 [rows, K]
    edges: list[int]  # the distance buckets: [edges[b], edges[b + 1])

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def facts_per_row(self) -> int:
        return self.answer_start.shape[1]

    def row(self, i: int) -> dict:
        """The trainer's row: only the answers' value tokens labelled (labels not yet shifted)."""
        ids = torch.from_numpy(self.tokens[i].astype(np.int64))
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[self.slots(i) >= 0] = ids[self.slots(i) >= 0]
        return {"input_ids": ids, "position_ids": torch.arange(len(ids)), "labels": labels,
                "real_tokens": len(ids)}

    def slots(self, i: int) -> torch.Tensor:
        """[L] long: the fact j whose answer value holds each token, -1 elsewhere."""
        out = torch.full((self.tokens.shape[1],), -1, dtype=torch.long)
        for j, (a, n) in enumerate(zip(self.answer_start[i].tolist(), self.value_len[i].tolist())):
            if a >= 0:
                out[a:a + n] = j
        return out

    def by_distance(self, recalled: np.ndarray, present: np.ndarray) -> tuple[list[float | None], list[int]]:
        """(accuracy, facts) per distance bucket of the facts `present` [rows, K] bool: `recalled` [rows, K] bool;
        accuracy None for a bucket without facts."""
        bucket = np.searchsorted(np.asarray(self.edges[1:-1]), self.distance, side="right")  # [rows, K]
        k = len(self.edges) - 1
        facts = np.bincount(bucket[present], minlength=k)
        hits = np.bincount(bucket[present & recalled], minlength=k)
        return [float(h / f) if f else None for h, f in zip(hits, facts)], [int(f) for f in facts]


def _targets(edges: Sequence[int], per_bucket: int) -> list[float]:
    """Distances log-spaced inside each bucket, per_bucket of them (the first bucket from its top 1/8 up)."""
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        lo = max(lo, hi / 8)
        out += [lo * (hi / lo) ** ((k + 0.5) / per_bucket) for k in range(per_bucket)]
    return out


def _facts(rng: random.Random, targets: list[float], encode: Callable[[str], list[int]]) -> list[_Fact]:
    facts = []
    for (key, (attr, value)), target in zip(new_facts(rng, len(targets)).items(), targets):
        pre, val, post = fact_statement(key, attr, value)
        s_pre, s_val, s_post = encode("\n" + pre), encode(val), encode(post + "\n")
        q_pre, q_val, q_post = fact_question(key, attr, value)
        a_pre, a_val, a_post = encode(q_pre), encode(q_val), encode(q_post + "\n")
        assert s_val == a_val  # the same text tokenized alone: the same tokens in both places
        facts.append(_Fact(s_pre + s_val + s_post, len(s_pre), a_pre + a_val + a_post, len(a_pre), len(a_val),
                           target))
    return facts


def _fitting_facts(rng: random.Random, edges: Sequence[int], length: int, header: list[int],
                   encode: Callable[[str], list[int]]) -> list[_Fact]:
    """The most facts per bucket (FACTS_PER_BUCKET down to 1) whose statements and questions fit the tail."""
    budget = length // TAIL_SHARE
    for per_bucket in range(FACTS_PER_BUCKET, 0, -1):
        facts = _facts(random.Random(rng.random()), _targets(edges, per_bucket), encode)
        if len(header) + sum(len(f.statement) + len(f.question) for f in facts) <= budget:
            return facts
    need = len(header) + sum(len(f.statement) + len(f.question) for f in facts)
    raise ConfigError(f"eval_recall_probe: one fact per position bucket takes {need} tokens, more than a "
                      f"1/{TAIL_SHARE} of max_length {length}; raise max_length to at least {need * TAIL_SHARE} "
                      f"or set eval_recall_probe false")


def probe_row(haystack: Callable[[int], np.ndarray], length: int, edges: Sequence[int], seed: str,
              encode: Callable[[str], list[int]]) -> tuple[np.ndarray, list[int], list[int], list[int]]:
    """(tokens [length], answer value starts, value lengths, distances) of one probe row; haystack(n) gives
    the first n tokens of its text."""
    rng = random.Random(seed)
    header = encode(HEADER)
    facts = _fitting_facts(rng, edges, length, header, encode)
    facts.sort(key=lambda f: f.target)  # the nearest asked first: short distances need answers early in the tail
    tail = list(header)
    answers = []
    for f in facts:
        answers.append(len(tail) + f.answer_at)
        tail += f.question
    tail_start = length - len(tail)
    answers = [tail_start + a for a in answers]
    # each statement where its value is `target` before its answer, then moved earlier (never later) so that
    # the statements neither overlap nor reach the tail
    starts, end = [0] * len(facts), tail_start
    for i in sorted(range(len(facts)), key=lambda i: -(answers[i] - facts[i].target - facts[i].value_at)):
        want = int(round(answers[i] - facts[i].target)) - facts[i].value_at
        starts[i] = max(0, min(want, end - len(facts[i].statement)))
        end = starts[i]
    text = haystack(tail_start - sum(len(f.statement) for f in facts))
    out, used = [], 0
    for i in sorted(range(len(facts)), key=lambda i: starts[i]):
        take = max(0, starts[i] - len(out))
        out += text[used:used + take].tolist()
        used += take
        starts[i] = len(out)  # (statements pushed to 0 stay in order)
        out += facts[i].statement
    out += text[used:].tolist()
    out += tail
    assert len(out) == length, (len(out), length)
    distances = [answers[i] - (starts[i] + facts[i].value_at) for i in range(len(facts))]
    return np.asarray(out, dtype=np.int32), answers, [f.value_len for f in facts], distances


def build_recall_probe(eval_data, edges: Sequence[int], seed: int, encode: Callable[[str], list[int]],
                       num_rows: int | None = None) -> RecallProbe:
    """A probe row for each of the first `num_rows` eval rows (default all: the rows an evaluation reads); row i's
    haystack is eval row i's real tokens, then row i+1's, ... (cycling over the eval rows)."""
    length, n = eval_data.max_length, len(eval_data)

    def haystack(i: int) -> Callable[[int], np.ndarray]:
        def first(count: int) -> np.ndarray:
            parts, have, j = [], 0, i
            while have < count:
                real = eval_data.real_tokens(j % n)
                part = eval_data.tokens[(j % n) * length:(j % n) * length + real][:count - have]
                parts.append(part)
                have += len(part)
                j += 1
                if j - i > n and have == 0:
                    raise ConfigError("eval_recall_probe: the eval rows hold no tokens to place the facts in")
            return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        return first

    rows = [probe_row(haystack(i), length, edges, f"{_SEED}:{seed}:{i}", encode) for i in range(min(num_rows or n, n))]
    k = max(len(r[1]) for r in rows)

    def table(col: int) -> np.ndarray:
        return np.asarray([r[col] + [-1] * (k - len(r[col])) for r in rows], dtype=np.int64)

    return RecallProbe(np.stack([r[0] for r in rows]), table(1), table(2), table(3), list(edges))
