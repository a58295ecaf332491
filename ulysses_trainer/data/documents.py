"""The long-document builder: documents -> tokens + eos, joined end to end, cut into max_length rows.

Sources: an HF dataset name (`datasets.load_dataset`), local files (parquet, jsonl/json, txt, arrow,
csv) or a directory of them (or one written by `save_to_disk`), or, with dataset_name null, the
synthetic generator. Every rank builds the same sequences deterministically; the trainer picks rows.
A `.txt` file is one document, newlines kept (text_file_split: paragraph or line splits it); a jsonl
file gives one document per record.

position_ids: without packing, 0..max_length-1 in every row (attention spans the joined documents,
as the reference PG-19 run does). With packing they restart at 0 at every document start and at
every row start (a document cut by a row boundary continues as a fresh segment), which is where
sharding puts its document boundaries (cu_seqlens) and masks the cross-document target.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import TrainConfig
from ..errors import ConfigError
from ..parallel.sharding import IGNORE_INDEX
from .accounting import DataCounts
from .agent_sessions import agent_sessions, mixed_agent_sessions
from .chat import tokenize_segments
from .chat_template import TemplateRenderer
from .formats import (
    ACCEPTED,
    CONVERSATIONAL,
    LANGUAGE_MODELING,
    check_first_example,
    check_loss_flags,
    check_settings_for_kind,
    detect_format,
    example_segments,
    rows_of,
)
from .loading import load_text_dataset
from .qwen3_template import is_qwen3_template
from .rows import build_rows
from .synthetic import synthetic_documents
from .tokenizer import Tokenizer
from .workers import chunks_of, ordered_map, text_size

_TOKENS_PER_WORD = 1.26  # of the synthetic prose under the Qwen BPE (measured)
_EVAL_SEED_OFFSET = 1_000_003  # synthetic eval documents differ from the training ones
_BATCH_DOCS = 64
_CHUNK_CHARS = 1 << 20  # a batch (a worker's share): at most _BATCH_DOCS documents or rows, or about this much text
SYNTHETIC_STEPS_PER_EPOCH = 4
AGENT_SESSIONS = "synthetic:agent_sessions"  # dataset_name of the synthetic agent sessions
MIXED_SESSIONS = "synthetic:agent_sessions_mixed"  # ... of mixed lengths (4K-400K tokens, median 60K)
NO_FIELD = "without the text field (missing or null)"
EMPTY = "empty text"


@dataclass
class SequenceDataset:
    """Rows of exactly max_length tokens. Indexing gives {"input_ids", "position_ids", "labels"}:
    LongTensor[L] (labels: the token where it is trained, IGNORE_INDEX elsewhere; not yet shifted), and
    "real_tokens": int, the row's tokens before its padding."""

    tokens: np.ndarray  # int32 [n_rows * L]
    positions: np.ndarray | None  # int32 [n_rows * L] with packing, else None (0..L-1 per row)
    max_length: int
    source: str
    documents_used: int
    documents_total: int | None  # None when the source's size is unknown (synthetic: endless)
    fraction_read: float | None = None  # of the source's text bytes, when tokenizing stopped early
    trained: np.ndarray | None = None  # bool [n_rows * L]: token is a trained target; None = every token
    lengths: np.ndarray | None = None  # real (non-pad) tokens per row; None = every row is full
    kind: str = LANGUAGE_MODELING
    pad_from: int | None = None  # index into tokens where the last row's padding starts (pad_last_sequence)
    counts: DataCounts = field(default_factory=DataCounts)  # what reading and building saw

    def real_tokens(self, i: int) -> int:
        """Tokens of row i that are not padding."""
        i %= len(self)
        if self.lengths is not None:
            return int(self.lengths[i])
        if self.pad_from is not None:  # the padded last row (pad_last_sequence)
            return max(0, min(self.max_length, self.pad_from - i * self.max_length))
        return self.max_length

    def __len__(self) -> int:
        return len(self.tokens) // self.max_length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        sl = slice(i * self.max_length, (i + 1) * self.max_length)
        ids = torch.from_numpy(self.tokens[sl].astype(np.int64))
        pos = torch.arange(self.max_length) if self.positions is None \
            else torch.from_numpy(self.positions[sl].astype(np.int64))
        labels = ids if self.trained is None else \
            torch.where(torch.from_numpy(self.trained[sl]), ids, IGNORE_INDEX)
        if self.pad_from is not None and sl.stop > self.pad_from:  # the padded last row: pads are not trained
            labels = labels.clone()
            labels[max(0, self.pad_from - sl.start):] = IGNORE_INDEX
        return {"input_ids": ids, "position_ids": pos, "labels": labels, "real_tokens": self.real_tokens(i)}

    @property
    def epoch_sequences(self) -> float:
        """Rows in one full pass over the source (estimated from the text read when stopped early: by
        bytes, since documents differ in length, else by document count)."""
        if self.fraction_read:
            return len(self) / self.fraction_read
        if self.documents_total and self.documents_used < self.documents_total:
            return len(self) * self.documents_total / self.documents_used
        return float(len(self))


# ---------------------------------------------------------------- sources


def _texts(ds: Any, field: str, source: str, counts: DataCounts) -> Iterator[str]:
    if len(ds) == 0:
        raise ConfigError(f"dataset {source} is empty; point dataset_name at data with documents")
    if field not in ds.column_names:
        raise ConfigError(f"dataset {source} has no field {field!r}; its fields are {ds.column_names}; "
                          f"set dataset_text_field to one of them")
    for batch in ds.select_columns([field]).iter(batch_size=256):
        for text in batch[field]:
            counts.read()
            if text is None:  # a jsonl record without the field reads as null
                counts.skip(NO_FIELD)
                continue
            if not isinstance(text, str):
                raise ConfigError(f"dataset {source}: field {field!r} holds {type(text).__name__} values, "
                                  f"not text; set dataset_text_field to a text column. Accepted: {ACCEPTED}")
            if not text:  # an empty document adds nothing, not even an eos
                counts.skip(EMPTY)
                continue
            yield text


def _encoded_batches(docs: Iterable[str], tokenizer: Tokenizer, num_proc: int | None
                     ) -> Iterator[tuple[list[str], list[list[int]]]]:
    """(documents, their ids) by batches of _BATCH_DOCS documents or about _CHUNK_CHARS of text, in order (num_proc:
    encoded in worker processes). The text bound keeps a capped read of long documents from generating and
    encoding many more than its rows need (64 synthetic 1M-token documents for 4 rows of 1M)."""
    held: deque[list[str]] = deque()  # batches handed to the workers, whose ids come back in this order

    def fed() -> Iterator[list[str]]:
        for raw in chunks_of(docs, _BATCH_DOCS, len, _CHUNK_CHARS):
            held.append([d for d in raw if d])  # (the sources skip and count empty documents themselves)
            yield held[-1]

    for ids in ordered_map(tokenizer.encode_batch, fed(), num_proc):
        yield held.popleft(), ids


# ---------------------------------------------------------------- building
def _pack(docs: Iterable[str], tokenizer: Tokenizer, max_length: int, packing: bool,
          max_rows: int | None, counts: DataCounts | None = None,
          pad_last: bool = False, num_proc: int | None = None
          ) -> tuple[np.ndarray, np.ndarray | None, int, int, int, int | None]:
    """(tokens, positions or None, documents used, tokens seen, text bytes used, pad start or None) of whole
    rows, stopping at max_rows. pad_last: the tokens after the last full row become one more row, padded
    (eos as the pad id; its labels are masked). num_proc: tokenizing workers (without max_rows only: workers
    read ahead, and a capped read must stop where its rows are full)."""
    counts = counts if counts is not None else DataCounts()
    chunks: list[np.ndarray] = []
    pos_chunks: list[np.ndarray] = []
    seen = used = text_bytes = 0
    need = None if max_rows is None else max_rows * max_length
    for batch, encoded in _encoded_batches(docs, tokenizer, None if need is not None else num_proc):
        for k, (doc, ids) in enumerate(zip(batch, encoded)):
            text_bytes += len(doc.encode("utf-8"))
            row = np.asarray(ids + [tokenizer.eos_token_id], dtype=np.int32)
            chunks.append(row)
            if packing:
                pos_chunks.append(np.arange(len(row), dtype=np.int32))
            seen += len(row)
            used += 1
            counts.use(len(row))
            if need is not None and seen >= need:
                counts.documents_read -= len(batch) - k - 1  # pulled from the source with the batch, not used
                break
        if need is not None and seen >= need:
            break  # (before the next batch is pulled from the source, which counts what it reads)
    rows = seen // max_length if max_rows is None else min(seen // max_length, max_rows)
    n = rows * max_length
    tail = seen - n if (max_rows is None or rows < max_rows) else 0
    pad_from = None
    if pad_last and tail and rows * max_length < seen:
        pad = max_length - tail
        chunks.append(np.full(pad, tokenizer.eos_token_id, np.int32))
        pad_from, rows, n = seen, rows + 1, (rows + 1) * max_length
        counts.finish(rows, max_length, tail, "padded", pad)
    else:
        stopped_early = max_rows is not None and rows == max_rows
        counts.finish(rows, max_length, 0 if stopped_early else tail,
                      "not read" if stopped_early else ("dropped" if tail else "none"))
    tokens = np.concatenate(chunks)[:n] if chunks else np.zeros(0, np.int32)
    positions = None
    if packing:
        doc_pos = np.concatenate(pos_chunks) if pos_chunks else np.zeros(0, np.int32)
        if pad_from is not None:  # the pads continue the last document's positions (they are masked)
            last = doc_pos[-1] + 1 if len(doc_pos) else 0
            doc_pos = np.concatenate([doc_pos, np.arange(last, last + n - len(doc_pos), dtype=np.int32)])
        doc_pos = doc_pos[:n]
        j = np.arange(n, dtype=np.int64)
        starts = (doc_pos == 0) | (j % max_length == 0)  # a new segment: document start or row start
        seg_start = np.maximum.accumulate(np.where(starts, j, 0))
        positions = (j - seg_start).astype(np.int32)
    return tokens, positions, used, seen, text_bytes, pad_from


def _column_bytes(ds: Any, field: str) -> int | None:
    """UTF-8 bytes of a text column, from Arrow's offsets (no text is read); None if not available."""
    try:
        import pyarrow.compute as pc

        return int(pc.sum(pc.binary_length(ds.data.column(field))).as_py() or 0)
    except Exception:  # noqa: BLE001 - an estimate only; the document count is the fallback
        return None


def default_num_sequences(cfg: TrainConfig, split: str, dp_size: int = 1) -> int:
    """Rows the synthetic source makes: 4 optimizer steps per epoch (so the no-argument run, which
    num_train_epochs 1 decides, trains 4 steps), whatever max_steps (which only says where the run stops)."""
    if split == "train":
        per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * dp_size
        return per_step * SYNTHETIC_STEPS_PER_EPOCH
    return 2 * cfg.per_device_eval_batch_size * dp_size


def build_sequences(cfg: TrainConfig, tokenizer: Tokenizer, split: str = "train", dp_size: int = 1,
                    num_sequences: int | None = None) -> SequenceDataset:
    """Tokenize, join and cut the configured data into rows of cfg.max_length tokens.

    split: "train" (dataset_name) or "eval" (eval_dataset_name, else dataset_test_split of
    dataset_name). num_sequences caps the rows read from a dataset (tokenizing stops there) and
    sets how many the synthetic source makes (default: default_num_sequences).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    L = cfg.max_length
    if split == "train":
        source, hf_split = cfg.dataset_name, cfg.dataset_train_split
    else:
        source, hf_split = cfg.eval_dataset_name or cfg.dataset_name, cfg.dataset_test_split
        if cfg.eval_dataset_name is None and source is not None and Path(source).exists():
            raise ConfigError(f"evaluation needs eval_dataset_name: dataset_name {source} is a local path "
                              f"with no test split")

    if source in (AGENT_SESSIONS, MIXED_SESSIONS) or (source is None and cfg.assistant_only_loss):
        source = source or AGENT_SESSIONS  # the conversational default
        rows = num_sequences or default_num_sequences(cfg, split, dp_size)
        seed = cfg.seed + (_EVAL_SEED_OFFSET if split == "eval" else 0)
        sessions = mixed_agent_sessions(seed) if source == MIXED_SESSIONS else agent_sessions(seed, mean_tokens=L)
        template = chat_template_of(tokenizer)
        check_settings_for_kind(CONVERSATIONAL, cfg, source, template)
        segments = example_segments(CONVERSATIONAL, sessions, source, cfg.assistant_only_loss, None,
                                    tokenizer.eos_token, template)
        return examples_dataset((tokenize_segments(s, tokenizer) for s in segments), cfg, tokenizer, source,
                                CONVERSATIONAL, None, rows)
    if source is None or source == "synthetic:text":
        check_settings_for_kind(LANGUAGE_MODELING, cfg, "synthetic:text", None)
        rows = num_sequences or default_num_sequences(cfg, split, dp_size)
        seed = cfg.seed + (_EVAL_SEED_OFFSET if split == "eval" else 0)
        docs = synthetic_documents(seed, mean_words=max(64, math.ceil(L / _TOKENS_PER_WORD)))
        counts = DataCounts(source="synthetic")
        if _whole_documents(cfg):
            return _documents_as_examples(_counted(docs, counts), cfg, tokenizer, "synthetic", None, rows, counts)
        tokens, positions, used, _, _, _ = _pack(_counted(docs, counts), tokenizer, L, cfg.packing, rows, counts)
        return SequenceDataset(tokens, positions, L, "synthetic", used, None, counts=counts)

    ds = load_text_dataset(source, hf_split, cfg.text_file_split)
    if len(ds) == 0:
        raise ConfigError(f"dataset {source} is empty; point dataset_name at data with documents")
    kind = detect_format(ds.column_names, cfg.dataset_text_field, source)
    check_loss_flags(kind, cfg.assistant_only_loss, source)
    template = chat_template_of(tokenizer) if kind != LANGUAGE_MODELING else None
    if kind != LANGUAGE_MODELING:
        check_first_example(kind, ds[0], source)
    check_settings_for_kind(kind, cfg, source, template, ds[0] if kind != LANGUAGE_MODELING else None)
    if kind != LANGUAGE_MODELING:
        shape: dict[str, int] = {}  # rows of another shape, by reason (filled as the rows are read)
        examples = _tokenized_examples(kind, rows_of(ds), source, cfg, tokenizer, template, shape,
                                       cfg.dataset_num_proc if num_sequences is None else None)
        return examples_dataset(examples, cfg, tokenizer, source, kind, len(ds), num_sequences, skipped=shape)
    counts = DataCounts(source=source, documents_total=len(ds))
    if _whole_documents(cfg):
        return _documents_as_examples(_texts(ds, cfg.dataset_text_field, source, counts), cfg, tokenizer, source,
                                      len(ds), num_sequences, counts, _column_bytes(ds, cfg.dataset_text_field))
    tokens, positions, used, seen, text_bytes, pad_from = _pack(
        _texts(ds, cfg.dataset_text_field, source, counts), tokenizer, L, cfg.packing, num_sequences, counts,
        pad_last=cfg.pad_last_sequence, num_proc=cfg.dataset_num_proc)
    if len(tokens) == 0:
        raise ConfigError(
            f"dataset {source} gives {seen} tokens ({used} documents + eos) but one sequence needs "
            f"max_length = {L} tokens; lower max_length to at most {seen} or add documents")
    fraction = None
    if used < len(ds):  # stopped early: the epoch is estimated from the share of the text read
        total = _column_bytes(ds, cfg.dataset_text_field)
        fraction = min(1.0, text_bytes / total) if total else None
    return SequenceDataset(tokens, positions, L, source, used, len(ds), fraction, pad_from=pad_from,
                           counts=counts)


def _tokenized_examples(kind: str, rows: Iterable[dict], source: str, cfg: TrainConfig, tokenizer: Tokenizer,
                        template: TemplateRenderer | None, skipped: dict[str, int], num_proc: int | None
                        ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, trained) of each example, rendered and tokenized in order (num_proc: by chunks of _BATCH_DOCS rows
    in worker processes; only where the whole dataset is read, as workers read ahead); rows of another shape
    are counted in `skipped`."""
    def work(chunk: tuple[int, list[dict]]) -> tuple[list[tuple[np.ndarray, np.ndarray]], dict[str, int]]:
        start, part = chunk
        shape: dict[str, int] = {}
        segments = example_segments(kind, part, source, cfg.assistant_only_loss, cfg.completion_only_loss,
                                    tokenizer.eos_token, template, skipped=shape, start=start)
        return [tokenize_segments(s, tokenizer) for s in segments], shape

    if not num_proc or num_proc <= 1:  # one example at a time: a capped read stops where its rows are full
        segments = example_segments(kind, rows, source, cfg.assistant_only_loss, cfg.completion_only_loss,
                                    tokenizer.eos_token, template, skipped=skipped)
        yield from (tokenize_segments(s, tokenizer) for s in segments)
        return
    def numbered() -> Iterator[tuple[int, list[dict]]]:
        start = 0
        for part in chunks_of(rows, _BATCH_DOCS, text_size, _CHUNK_CHARS):
            yield start, part
            start += len(part)

    for examples, shape in ordered_map(work, numbered(), num_proc):
        for reason, n in shape.items():
            skipped[reason] = skipped.get(reason, 0) + n
        yield from examples


def chat_template_of(tokenizer: Tokenizer) -> TemplateRenderer | None:
    """The checkpoint's own chat template where its tokenizer has one; None: Qwen3's format, built in (also for
    Qwen3's shipped template, which the built-in format renders byte for byte, in TRL's training variant with
    assistant_only_loss)."""
    hf = getattr(tokenizer, "hf_tokenizer", None)
    template = getattr(hf, "chat_template", None) if hf is not None else None
    return TemplateRenderer(hf, tokenizer.name) if template and not is_qwen3_template(template) else None


def examples_dataset(examples: Iterable[tuple[np.ndarray, np.ndarray]], cfg: TrainConfig, tokenizer: Tokenizer,
                     source: str, kind: str, total: int | None, num_sequences: int | None,
                     skipped: dict[str, int] | None = None) -> SequenceDataset:
    """Rows of whole examples (one per row, or packed) with their trained masks. skipped: rows the reader left
    out before tokenizing, by reason (read, and counted as skipped)."""
    tokens, trained, positions, lengths, counts = build_rows(
        examples, cfg.max_length, cfg.packing, cfg.max_length_policy, tokenizer.eos_token_id, num_sequences,
        cfg.packing_strategy)
    for reason, n in (skipped or {}).items():
        counts.examples_read += n
        counts.skipped[reason] = counts.skipped.get(reason, 0) + n
    if counts.sequences == 0:
        why = f"{counts.dropped_too_long} longer than max_length {cfg.max_length} were dropped " \
              f"(max_length_policy drop)" if counts.dropped_too_long else "none holds a token"
        raise ConfigError(f"dataset {source} gives no sequence: {counts.examples_read} examples read, {why}; "
                          f"add examples or raise max_length")
    fraction = None
    if total is not None and counts.examples_read < total:  # stopped early: the epoch is estimated by count
        fraction = counts.examples_read / total
    return SequenceDataset(tokens, positions, cfg.max_length, source, counts.examples_used, total, fraction,
                           trained=trained, lengths=lengths, kind=kind,
                           counts=DataCounts.of_examples(counts, source, total, cfg.max_length))


def _whole_documents(cfg: TrainConfig) -> bool:
    """Text documents packed whole (bfd, next_fit) go through the examples' row builder; `wrapped` and
    packing false join and cut them."""
    return cfg.packing and cfg.packing_strategy != "wrapped"


def _documents_as_examples(docs: Iterable[str], cfg: TrainConfig, tokenizer: Tokenizer, source: str,
                           total: int | None, num_sequences: int | None, read: DataCounts,
                           total_bytes: int | None = None) -> SequenceDataset:
    """Text documents (+ eos, every token trained) packed whole; `read` holds what the source skipped."""
    text_bytes = 0

    def examples() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        nonlocal text_bytes
        for batch, encoded in _encoded_batches(docs, tokenizer, cfg.dataset_num_proc if num_sequences is None
                                               else None):  # bfd reads on past the rows it needs: no workers
            for doc, ids in zip(batch, encoded):
                text_bytes += len(doc.encode("utf-8"))
                row = np.asarray(ids + [tokenizer.eos_token_id], dtype=np.int32)
                yield row, np.ones(len(row), bool)

    ds = examples_dataset(examples(), cfg, tokenizer, source, LANGUAGE_MODELING, total, num_sequences)
    ds.counts.skipped.update(read.skipped)
    ds.counts.documents_read += sum(read.skipped.values())
    if total is None or ds.counts.documents_read >= total:
        ds.fraction_read = None
    else:  # stopped early: the epoch is estimated by bytes (documents differ in length), else by count
        ds.fraction_read = min(1.0, text_bytes / total_bytes) if total_bytes else ds.counts.documents_read / total
    return ds


def _counted(docs: Iterable[str], counts: DataCounts) -> Iterator[str]:
    for doc in docs:
        counts.read()
        yield doc
