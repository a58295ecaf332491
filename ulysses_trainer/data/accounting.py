"""What happened to the data on its way to sequences: documents read, used, skipped (why, how many),
tokens, sequences, and what was dropped or padded at the end.

One DataCounts goes with the data from the source to the rows: a source counts what it leaves out
(`skip(reason)`), the row builder (data/rows.py) what it takes (`take()`, `use(tokens)`) and
the rows it makes; a document is read when it is taken or skipped. The trainer prints `summary()` before
training and stores `to_dict()` in config.json.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

DROPPED_TOO_LONG = "longer than max_length (max_length_policy drop)"  # a skip reason
DROPPED_SPECIAL_TEXT = "holding a special token's text (special_text drop)"  # a skip reason
# a skip reason under special_text encode: the example holds the private-use characters its encoding uses
UNENCODABLE_SPECIAL_TEXT = "holding a special token's text and the private-use characters U+F0000.. that encode it"


@dataclass
class DataCounts:
    source: str = ""
    taken: int = 0  # documents a row builder took (used, or truncated into a row)
    documents_used: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> documents
    tokens: int = 0  # tokens of the used documents (eos included)
    sequences: int = 0
    max_length: int = 0
    tail_tokens: int = 0  # tokens after the last full sequence
    tail: str = "none"  # what happened to them: "dropped" | "padded" | "none" | "not read" (stopped early)
    pad_tokens: int = 0
    documents_total: int | None = None  # rows in the source, when known
    # rows of whole examples (not joined text) count these too; they show in `details`
    whole_examples: bool = False
    truncated: int = 0
    dropped_too_long: int = 0
    without_trained_tokens: int = 0
    trained_cut_off: int = 0  # truncated examples whose trained tokens all lay past max_length
    split: int = 0  # examples cut by a row edge (packing_strategy wrapped)
    trained_tokens: int = 0  # tokens that are a trained target (an example's first token never is)
    rows_over_10pct_padding: int = 0  # rows whose pads are more than a tenth of max_length
    padding_why: str = ""  # why those rows could not be fuller (rows.padding_report)
    special_text: int = 0  # examples whose message text holds a special token's string (encoded or dropped)

    @property
    def documents_read(self) -> int:
        """Documents taken or skipped (an example is a document here)."""
        return self.taken + sum(self.skipped.values())

    @property
    def details(self) -> dict[str, Any]:
        """Whole examples' counts: read, used, truncated, trained tokens, rows over 10% padding and why ({} for
        text joined and cut)."""
        if not self.whole_examples:
            return {}
        return {"examples_read": self.documents_read, "examples_used": self.documents_used,
                "truncated": self.truncated, "dropped_too_long": self.dropped_too_long,
                "without_trained_tokens": self.without_trained_tokens, "trained_cut_off": self.trained_cut_off,
                "split": self.split, "trained_tokens": self.trained_tokens,
                "rows_over_10pct_padding": self.rows_over_10pct_padding, "padding_why": self.padding_why,
                "special_text": self.special_text}

    @property
    def fill_ratio(self) -> float:
        """Real tokens / sequence tokens of the rows built (1.0: no pads)."""
        room = self.sequences * self.max_length
        return round(1.0 - self.pad_tokens / room, 4) if room else 0.0

    def take(self) -> None:
        self.taken += 1

    def skip(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + n

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
        if self.whole_examples:
            end += f"; {self.trained_tokens} trained tokens, " \
                   f"{self.truncated} truncated to max_length, {self.pad_tokens} pad tokens"
        if self.special_text:
            dropped = self.skipped.get(DROPPED_SPECIAL_TEXT, 0) + self.skipped.get(UNENCODABLE_SPECIAL_TEXT, 0)
            how = f"{dropped} dropped" if dropped == self.special_text else \
                "encoded as text, never as the token" if not dropped else f"{dropped} of them dropped"
            n = self.special_text
            end += f"; {n} example{'s' if n != 1 else ''} held a special token's text ({how}; special_text)"
        end += f"; fill {100 * self.fill_ratio:.1f}% (real tokens / sequence tokens)"
        heavy = self.rows_over_10pct_padding if self.whole_examples else 0
        if heavy:
            end += f"; {heavy} of {self.sequences} sequences over 10% padding: {self.padding_why}"
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
    if not counts.whole_examples or counts.trained_tokens > 0:
        return  # text: every token but a document's first is trained
    none, cut = counts.without_trained_tokens, counts.trained_cut_off
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
