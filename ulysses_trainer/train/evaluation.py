"""Evaluation, sharded exactly like training: the eval loss, the loss by position and the recall probe.

Loss by position: each target token's loss counts in the bucket of its position in its document (the token's
index there: the number of tokens before it that the model sees; position_ids restart at every packed document;
without packing a row is documents joined end to end and attention spans the row, so the position is the
row's). Buckets double from FIRST_EDGE: [0, 128), [128, 256), [256, 512), ... up to max_length (position_edges).
The sums are taken inside the lm_head's chunked loss (levers/chunked_loss.chunked_bucket_sums: per-rank sums of
loss and tokens per bucket, never the logits) and all-reduced once per evaluation; eval_loss is their total.

Collective invariant: every rank runs the same rounds (the same forward calls, so ZeRO-3's gathers pair up)
and one all-reduce per evaluation, the recall probe's included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..data.recall_probe import RecallProbe
from ..model.parallelize import SequenceParallelCausalLM
from ..parallel.comm import all_reduce_sum
from ..parallel.sharding import Shard
from ..parallel.state import ParallelState

FIRST_EDGE = 128  # the first bucket, [0, 128): the loss with little context


def position_edges(max_length: int) -> list[int]:
    """Bucket edges over positions: 0, 128, 256, ... (doubling while below max_length), max_length."""
    edges, e = [0], FIRST_EDGE
    while e < max_length:
        edges.append(e)
        e *= 2
    return edges + [max_length]


def position_buckets(position_ids: torch.Tensor, edges: list[int]) -> torch.Tensor:
    """Each target's bucket, labels' shape: labels[t] is the token after input t, at position position_ids[t] + 1
    of its document (a pad's position runs past max_length: its label is ignored, its bucket the last)."""
    inner = torch.tensor(edges[1:-1], dtype=position_ids.dtype, device=position_ids.device)
    return torch.bucketize(position_ids + 1, inner, right=True)


@dataclass
class EvalResult:
    loss: float
    edges: list[int]
    position_loss: list[float | None]  # mean loss per position bucket; None without a target there
    position_tokens: list[int]
    recall: float | None = None  # the probe's recalled facts / facts (None: no probe)
    recall_accuracy: list[float | None] | None = None  # per distance bucket (the same edges)
    recall_facts: list[int] | None = None

    def fields(self) -> dict:
        """The eval row's fields of metrics.jsonl (beside `step`)."""
        row = {"eval_loss": self.loss,
               "eval_loss_by_position": {"edges": self.edges, "loss": self.position_loss,
                                         "tokens": self.position_tokens}}
        if self.recall is not None:
            row["eval_recall"] = self.recall
            row["eval_recall_by_distance"] = {"edges": self.edges, "accuracy": self.recall_accuracy,
                                              "facts": self.recall_facts}
        return row


def covered_rows(rows: int, per_device: int, dp_size: int) -> int:
    """The rows an evaluation reads: whole rounds of per_device rows on every dp rank."""
    per_round = per_device * dp_size
    return rows // per_round * per_round


def _rounds(rows: int, per_device: int, state: ParallelState, desc: str) -> Iterator[list[int]]:
    """This rank's row indices of each round: every rank runs the same number of rounds."""
    per_round = per_device * state.dp_size
    lo = state.dp_rank * per_device
    for start in tqdm(range(0, covered_rows(rows, per_device, state.dp_size), per_round), desc=desc, unit="batch",
                      leave=False, dynamic_ncols=True, disable=not state.is_main):
        yield list(range(start + lo, start + lo + per_device))


@torch.no_grad()
def evaluate(model: SequenceParallelCausalLM, eval_data, per_device: int, max_length: int,
             state: ParallelState, shard: Callable[[list[dict]], Shard], probe: RecallProbe | None = None
             ) -> EvalResult:
    """One evaluation: model.eval_sums of each round's shard (the engine's SequenceParallelCausalLM);
    shard(rows) -> this rank's shard. Collective."""
    edges = position_edges(max_length)
    k = len(edges) - 1
    position = torch.zeros(k, 3, dtype=torch.float64)  # NLL, hits, tokens per position bucket
    for rows in _rounds(len(eval_data), per_device, state, "eval"):
        s = shard([eval_data[i] for i in rows])  # SequenceDataset takes int indices
        position += model.eval_sums(s, position_buckets(s.context.position_ids, edges), k).cpu()
    facts = None
    if probe is not None:
        facts = torch.zeros(len(probe) * probe.facts_per_row, 3, dtype=torch.float64)  # per fact of every row
        for rows in _rounds(len(probe), per_device, state, "recall probe"):
            s = shard([probe.row(i) for i in rows])
            facts[_fact_index(rows, probe.facts_per_row)] += model.eval_sums(
                s, _fact_buckets(s, rows, probe), len(rows) * probe.facts_per_row).cpu()
    # one all-reduce: every rank's bucket sums, and its facts (each row's facts only on its dp group's ranks)
    flat = torch.cat([position.reshape(-1), facts.reshape(-1) if facts is not None else position.new_zeros(0)])
    flat = all_reduce_sum(flat)
    position, facts = flat[:3 * k].view(k, 3), flat[3 * k:].view(-1, 3) if facts is not None else None
    tokens = position[:, 2]
    result = EvalResult(loss=float(position[:, 0].sum()) / max(float(tokens.sum()), 1.0), edges=edges,
                        position_loss=[float(s / n) if n else None for s, n in zip(position[:, 0], tokens)],
                        position_tokens=[int(n) for n in tokens])
    if probe is not None:
        hits, counted = facts[:, 1].view(len(probe), -1).numpy(), facts[:, 2].view(len(probe), -1).numpy()
        # recalled: every value token was counted and is an argmax (a row's facts absent: value_len -1)
        recalled = (counted == probe.value_len) & (hits == counted)
        read = covered_rows(len(probe), per_device, state.dp_size)
        recalled[read:] = False
        present = probe.answer_start >= 0
        present[read:] = False
        result.recall_accuracy, result.recall_facts = probe.by_distance(recalled, present)
        result.recall = float(recalled[present].sum() / max(int(present.sum()), 1))
    return result


def _fact_index(rows: list[int], per_row: int) -> torch.Tensor:
    """The facts of `rows` in the whole probe's fact table ([rows x per_row])."""
    return (torch.tensor(rows)[:, None] * per_row + torch.arange(per_row)[None, :]).reshape(-1)


def _fact_buckets(s: Shard, rows: list[int], probe: RecallProbe) -> torch.Tensor:
    """Each target's fact in this micro-batch (row r's fact j: r * per_row + j), labels' shape. A probe row is one
    document, so labels[t]'s token sits at position_ids[t] + 1; tokens outside an answer take bucket 0 (their
    labels are ignored)."""
    slots = torch.stack([probe.slots(i) for i in rows]).to(s.context.position_ids.device)  # [b, L]
    at = (s.context.position_ids + 1).clamp(max=slots.shape[1] - 1)  # [b, s/sp]; pads run past L
    slot = slots.gather(1, at).clamp(min=0)  # [b, s/sp]
    return slot + torch.arange(len(rows), device=slot.device)[:, None] * probe.facts_per_row

