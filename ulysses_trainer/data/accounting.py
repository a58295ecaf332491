"""What happened to the data on its way to sequences: documents read, used, skipped (why, how many),
tokens, sequences, and what was dropped or padded at the end.

A loader fills one DataCounts as it goes (`skip(reason)`, `use(tokens)`), the builder records the tail
(`finish`); the trainer prints `summary()` before training and stores `to_dict()` in config.json.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError


@dataclass
class DataCounts:
    source: str = ""
    documents_read: int = 0
    documents_used: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> documents
    tokens: int = 0  # tokens of the used documents (eos included)
    sequences: int = 0
    max_length: int = 0
    tail_tokens: int = 0  # tokens after the last full sequence
    tail: str = "none"  # what happened to them: "dropped" | "padded" | "none" | "not read" (stopped early)
    pad_tokens: int = 0
    documents_total: int | None = None  # rows in the source, when known
    # whole examples: read, used, truncated, trained tokens, rows over 10% padding and why (data/rows.RowCounts)
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of_examples(cls, rows: Any, source: str, total: int | None, max_length: int) -> DataCounts:
        """The counts of rows built from whole examples (data/rows.RowCounts): an example is a document here."""
        skipped = dict(rows.skipped)
        if rows.dropped_too_long:
            skipped["longer than max_length (max_length_policy drop)"] = rows.dropped_too_long
        return cls(source=source, documents_read=rows.examples_read, documents_used=rows.examples_used,
                   skipped=skipped, tokens=rows.tokens, sequences=rows.sequences, max_length=max_length,
                   tail="none", pad_tokens=rows.pad_tokens, documents_total=total,
                   details={k: v for k, v in vars(rows).items()
                            if k not in ("skipped", "sequences", "tokens", "pad_tokens")})

    @property
    def fill_ratio(self) -> float:
        """Real tokens / sequence tokens of the rows built (1.0: no pads)."""
        room = self.sequences * self.max_length
        return round(1.0 - self.pad_tokens / room, 4) if room else 0.0

    def read(self) -> None:
        self.documents_read += 1

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def use(self, tokens: int) -> None:
        self.documents_used += 1
        self.tokens += tokens

    def finish(self, sequences: int, max_length: int, tail_tokens: int, tail: str, pad_tokens: int = 0) -> None:
        self.sequences, self.max_length = sequences, max_length
        self.tail_tokens, self.tail, self.pad_tokens = tail_tokens, tail, pad_tokens

    def summary(self) -> str:
        """One line for the log."""
        skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())) or "none"
        total = f" of {self.documents_total}" if self.documents_total is not None and \
            self.documents_total != self.documents_read else ""
        if self.tail == "dropped":
            end = f"last {self.tail_tokens} tokens dropped (set pad_last_sequence true to keep them)"
        elif self.tail == "padded":
            end = f"last sequence padded with {self.pad_tokens} pad tokens (not trained on)"
        elif self.tail == "not read":
            end = "reading stopped once the run's sequences existed"
        else:
            end = "nothing dropped"
        if self.details:
            end += f"; {self.details.get('trained_tokens', 0)} trained tokens, " \
                   f"{self.details.get('truncated', 0)} truncated to max_length, {self.pad_tokens} pad tokens"
        end += f"; fill {100 * self.fill_ratio:.1f}% (real tokens / sequence tokens)"
        heavy = self.details.get("rows_over_10pct_padding", 0)
        if heavy:
            end += f"; {heavy} of {self.sequences} sequences over 10% padding: {self.details.get('padding_why', '')}"
        return (f"{self.source}: {self.documents_read}{total} documents read, {self.documents_used} used, "
                f"skipped: {skipped}; {self.tokens} tokens -> {self.sequences} sequences of {self.max_length}; "
                f"{end}")

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "documents_read": self.documents_read, "documents_used": self.documents_used,
                "documents_total": self.documents_total, "skipped": dict(self.skipped), "tokens": self.tokens,
                "sequences": self.sequences, "max_length": self.max_length, "tail_tokens": self.tail_tokens,
                "tail": self.tail, "pad_tokens": self.pad_tokens, "fill_ratio": self.fill_ratio, **self.details}


def check_something_trained(counts: DataCounts, what: str, assistant_only_loss: bool,
                            completion_only_loss: bool | None) -> None:
    """Whole examples whose masks leave no token to train on: an error before any model is built (a run would
    log loss 0.0, grad_norm 0.0 and export an untrained model)."""
    if not counts.details or counts.details.get("trained_tokens", 0) > 0:
        return  # text: every token but a document's first is trained
    none = counts.details.get("without_trained_tokens", 0)
    cut = counts.details.get("trained_cut_off", 0)
    if cut:  # the data has what trains; max_length cut it off
        part = "assistant turns" if assistant_only_loss else "completions" if completion_only_loss is not False \
            else "trained tokens"
        why = (f"{cut} of them had {part} that max_length {counts.max_length} cut off (max_length_policy truncate "
               f"keeps an example's first max_length tokens); raise max_length to hold them, or shorten the prompts "
               f"before them")
    elif assistant_only_loss:
        why = "assistant_only_loss true trains only assistant turns; add conversations with an assistant turn " \
              "or set assistant_only_loss false"
    elif completion_only_loss is not False:
        why = "completion_only_loss trains only the completions; add non-empty completions or set " \
              "completion_only_loss false"
    else:
        why = "add examples with more than one token"
    raise ConfigError(f"{what} {counts.source} has nothing to train on: {none} of {counts.documents_used} examples "
                      f"used have no trained token (0 trained tokens); {why}")
