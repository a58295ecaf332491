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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import TrainConfig
from ..config.checks import check_eval_source
from ..errors import ConfigError
from .accounting import DataCounts
from .agent_sessions import agent_sessions, mixed_agent_sessions
from .chat import tokenize_segments
from .chat_template import TemplateRenderer
from .formats import (
    ACCEPTED,
    CONVERSATIONAL,
    LANGUAGE_MODELING,
    SpecialTextPolicy,
    check_first_example,
    check_loss_flags,
    check_settings_for_kind,
    detect_format,
    example_segments,
    rows_of,
)
from .loading import load_text_dataset
from .qwen3_template import is_qwen3_template
from .rows import Rows, build_rows
from .sequences import SequenceDataset
from .synthetic import synthetic_documents
from .tokenizer import Tokenizer, special_texts
from .training_templates import training_variant
from .workers import chunks_of, ordered_map, text_size

_TOKENS_PER_WORD = 1.26  # of the synthetic prose under the Qwen BPE (measured)
_EVAL_SEED_OFFSET = 1_000_003  # synthetic eval documents differ from the training ones
SYNTHETIC_STEPS_PER_EPOCH = 4
AGENT_SESSIONS = "synthetic:agent_sessions"  # dataset_name of the synthetic agent sessions
MIXED_SESSIONS = "synthetic:agent_sessions_mixed"  # ... of mixed lengths (4K-400K tokens, median 60K)
BATCH_DOCS = 64
CHUNK_CHARS = 1 << 20  # a batch (a worker's share): at most BATCH_DOCS documents or rows, or about this much text
NO_FIELD = "without the text field (missing or null)"
EMPTY = "empty text"


# ---------------------------------------------------------------- sources


@dataclass
class _Source:
    """A source opened: its kind and what it yields (text documents, or (ids, trained) examples), with the
    counts that its reading and the row builder fill."""

    label: str  # the name the counts and messages use
    kind: str
    items: Iterable[Any]
    counts: DataCounts
    max_rows: int | None  # rows to build (None: all the source gives)
    total: int | None = None  # documents in the source, when known
    total_bytes: Callable[[], int | None] = lambda: None  # UTF-8 bytes of its text, when known


def _texts(ds: Any, field: str, source: str, counts: DataCounts) -> Iterator[str]:
    if field not in ds.column_names:
        raise ConfigError(f"dataset {source} has no field {field!r}; its fields are {ds.column_names}; "
                          f"set dataset_text_field to one of them")
    for batch in ds.select_columns([field]).iter(batch_size=256):
        for text in batch[field]:
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


ENDLESS_DROPS = 1000  # synthetic sessions never end: this many dropped with none kept is a refusal, not a wait


def _until_one_fits(examples: Iterator[Any], counts: DataCounts, source: str, cfg: TrainConfig) -> Iterator[Any]:
    """An endless synthetic stream, refused once its first ENDLESS_DROPS examples were all dropped as longer
    than max_length (the row builder counts them before it asks for the next): it would never fill a row."""
    for read, example in enumerate(examples):
        if read >= ENDLESS_DROPS and counts.dropped_too_long >= read:
            raise ConfigError(f"dataset {source}: the first {read} sessions are all longer than max_length "
                              f"{cfg.max_length} and were dropped (max_length_policy drop); raise max_length or "
                              f"use max_length_policy truncate")
        yield example


def _open(cfg: TrainConfig, tokenizer: Tokenizer, split: str, dp_size: int, num_sequences: int | None) -> _Source:
    """The configured source of `split`, its kind detected and the settings checked against it."""
    if split == "train":
        source, hf_split = cfg.dataset_name, cfg.dataset_train_split
    else:
        check_eval_source(cfg)
        source, hf_split = cfg.eval_dataset_name or cfg.dataset_name, cfg.dataset_test_split
    seed = cfg.seed + (_EVAL_SEED_OFFSET if split == "eval" else 0)
    if source in (AGENT_SESSIONS, MIXED_SESSIONS) or (source is None and cfg.assistant_only_loss):
        source = source or AGENT_SESSIONS  # the conversational default
        sessions = mixed_agent_sessions(seed) if source == MIXED_SESSIONS else \
            agent_sessions(seed, mean_tokens=cfg.max_length)
        template = chat_template_of(tokenizer)
        check_settings_for_kind(CONVERSATIONAL, cfg, source, template)
        segments = example_segments(CONVERSATIONAL, sessions, source, cfg.assistant_only_loss, None,
                                    tokenizer.eos_token, template)
        counts = DataCounts(source=source)
        examples = _until_one_fits((tokenize_segments(s, tokenizer) for s in segments), counts, source, cfg)
        return _Source(source, CONVERSATIONAL, examples, counts,
                       num_sequences or default_num_sequences(cfg, split, dp_size))
    if source is None or source == "synthetic:text":
        check_settings_for_kind(LANGUAGE_MODELING, cfg, "synthetic:text", None)
        docs = synthetic_documents(seed, mean_words=max(64, math.ceil(cfg.max_length / _TOKENS_PER_WORD)))
        return _Source("synthetic", LANGUAGE_MODELING, docs, DataCounts(source="synthetic"),
                       num_sequences or default_num_sequences(cfg, split, dp_size))

    ds = load_text_dataset(source, hf_split, cfg.text_file_split)
    kind = detect_format(ds.column_names, cfg.dataset_text_field, source)
    check_loss_flags(kind, cfg.assistant_only_loss, source)
    counts = DataCounts(source=source, documents_total=len(ds))
    if kind == LANGUAGE_MODELING:
        check_settings_for_kind(kind, cfg, source, None)
        return _Source(source, kind, _texts(ds, cfg.dataset_text_field, source, counts), counts, num_sequences,
                       len(ds), lambda: _column_bytes(ds, cfg.dataset_text_field))
    template = chat_template_of(tokenizer)
    check_first_example(kind, ds[0], source)
    check_settings_for_kind(kind, cfg, source, template, ds[0])
    examples = _tokenized_examples(kind, rows_of(ds), source, cfg, tokenizer, template, counts,
                                   cfg.dataset_num_proc if num_sequences is None else None)
    return _Source(source, kind, examples, counts, num_sequences, len(ds))


def _tokenized_examples(kind: str, rows: Iterable[dict], source: str, cfg: TrainConfig, tokenizer: Tokenizer,
                        template: TemplateRenderer | None, counts: DataCounts, num_proc: int | None
                        ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, trained) of each example, rendered and tokenized in order (num_proc: by chunks of BATCH_DOCS rows
    in worker processes; only where the whole dataset is read, as workers read ahead); rows of another shape
    are counted as skipped, by reason."""
    special = SpecialTextPolicy(cfg.special_text, special_texts(tokenizer))

    def work(chunk: tuple[int, list[dict]]) -> tuple[list[tuple[np.ndarray, np.ndarray]], dict[str, int], int]:
        start, part = chunk
        shape: dict[str, int] = {}
        tally = DataCounts()
        segments = example_segments(kind, part, source, cfg.assistant_only_loss, cfg.completion_only_loss,
                                    tokenizer.eos_token, template, skipped=shape, start=start, special=special,
                                    tally=tally)
        return [tokenize_segments(s, tokenizer) for s in segments], shape, tally.special_text

    if not num_proc or num_proc <= 1:  # one example at a time: a capped read stops where its rows are full
        segments = example_segments(kind, rows, source, cfg.assistant_only_loss, cfg.completion_only_loss,
                                    tokenizer.eos_token, template, skipped=counts.skipped, special=special,
                                    tally=counts)
        yield from (tokenize_segments(s, tokenizer) for s in segments)
        return
    def numbered() -> Iterator[tuple[int, list[dict]]]:
        start = 0
        for part in chunks_of(rows, BATCH_DOCS, text_size, CHUNK_CHARS):
            yield start, part
            start += len(part)

    for examples, shape, special_text in ordered_map(work, numbered(), num_proc):
        for reason, n in shape.items():
            counts.skip(reason, n)
        counts.special_text += special_text
        yield from examples


def chat_template_of(tokenizer: Tokenizer) -> TemplateRenderer | None:
    """The checkpoint's own chat template where its tokenizer has one (with TRL's training variant of a shipped
    template TRL knows, for assistant_only_loss: data/training_templates.py); None: Qwen3's format, built in (also
    for Qwen3's shipped template, which the built-in format renders byte for byte, in TRL's training variant with
    assistant_only_loss)."""
    hf = getattr(tokenizer, "hf_tokenizer", None)
    template = getattr(hf, "chat_template", None) if hf is not None else None
    if not template or is_qwen3_template(template):
        return None
    return TemplateRenderer(hf, tokenizer.name, training_variant(template))


# ---------------------------------------------------------------- building


def build_sequences(cfg: TrainConfig, tokenizer: Tokenizer, split: str = "train", dp_size: int = 1,
                    num_sequences: int | None = None) -> SequenceDataset:
    """Tokenize, join and cut the configured data into rows of cfg.max_length tokens.

    split: "train" (dataset_name) or "eval" (eval_dataset_name, else dataset_test_split of
    dataset_name). num_sequences caps the rows read from a dataset (tokenizing stops there) and
    sets how many the synthetic source makes (default: default_num_sequences).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    src = _open(cfg, tokenizer, split, dp_size, num_sequences)
    rows = _rows(src, cfg, tokenizer)
    counts, L = rows.counts, cfg.max_length
    if len(rows.tokens) == 0 and not counts.whole_examples:
        raise ConfigError(
            f"dataset {src.label} gives {counts.tokens} tokens ({counts.documents_used} documents + eos) but one "
            f"sequence needs max_length = {L} tokens; lower max_length to at most {counts.tokens} or add documents")
    if len(rows.tokens) == 0:
        why = f"{counts.dropped_too_long} longer than max_length {L} were dropped " \
              f"(max_length_policy drop)" if counts.dropped_too_long else "none holds a token"
        raise ConfigError(f"dataset {src.label} gives no sequence: {counts.documents_read} examples read, {why}; "
                          f"add examples or raise max_length")
    return SequenceDataset(rows.tokens, rows.positions, L, src.label, counts.documents_used, src.total,
                           _fraction_read(src, rows), trained=rows.trained, lengths=rows.lengths, kind=src.kind,
                           pad_from=rows.pad_from, counts=counts)


def encoded_batches(docs: Iterable[str], tokenizer: Tokenizer, num_proc: int | None
                    ) -> Iterator[tuple[list[str], list[list[int]]]]:
    """(documents, their ids) by batches of BATCH_DOCS documents or about CHUNK_CHARS of text, in order (num_proc:
    encoded in worker processes). The text bound keeps a capped read of long documents from generating and
    encoding many more than its rows need (64 synthetic 1M-token documents for 4 rows of 1M)."""
    held: deque[list[str]] = deque()  # batches handed to the workers, whose ids come back in this order

    def fed() -> Iterator[list[str]]:
        for raw in chunks_of(docs, BATCH_DOCS, len, CHUNK_CHARS):
            held.append([d for d in raw if d])  # (the sources skip and count empty documents themselves)
            yield held[-1]

    for ids in ordered_map(tokenizer.encode_batch, fed(), num_proc):
        yield held.popleft(), ids


def _whole_documents(cfg: TrainConfig) -> bool:
    """Text documents packed whole (bfd, next_fit); `wrapped` and packing false join and cut them."""
    return cfg.packing and cfg.packing_strategy != "wrapped"


def _rows(src: _Source, cfg: TrainConfig, tokenizer: Tokenizer) -> Rows:
    """The source's rows, from the one row builder (rows.build_rows): text joined and cut (tail: pad_last_sequence)
    or packed whole, and examples one per row or packed, as the settings pick the strategy."""
    num_proc = cfg.dataset_num_proc if src.max_rows is None else None  # workers read ahead: whole reads only
    text = src.kind == LANGUAGE_MODELING
    joined = text and not _whole_documents(cfg)
    examples, text_bytes = src.items, [0]
    if text:  # each document + eos, every token trained (the builder masks a packed document's first)
        def documents() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for batch, encoded in encoded_batches(src.items, tokenizer, num_proc):
                for doc, ids in zip(batch, encoded):
                    text_bytes[0] += len(doc.encode("utf-8"))
                    row = np.asarray(ids + [tokenizer.eos_token_id], dtype=np.int32)
                    yield row, np.ones(len(row), bool)

        examples = documents()
    tail = ("pad" if cfg.pad_last_sequence else "drop") if joined else "pad"
    rows = build_rows(examples, cfg.max_length, cfg.packing, cfg.max_length_policy, tokenizer.eos_token_id,
                      src.max_rows, "joined" if joined else cfg.packing_strategy, src.counts, tail)
    rows.text_bytes = text_bytes[0]
    return rows


def _fraction_read(src: _Source, rows: Rows) -> float | None:
    """The share of the source read when reading stopped early (None: all of it, or its size is unknown): by
    text bytes where they are known (documents differ in length), else by document count."""
    counts = rows.counts
    if src.total is None:
        return None
    if not counts.whole_examples:  # joined and cut
        if counts.documents_used >= src.total:
            return None
        total = src.total_bytes()
        return min(1.0, rows.text_bytes / total) if total else None
    if counts.documents_read >= src.total:
        return None
    total = src.total_bytes() if src.kind == LANGUAGE_MODELING else None
    return min(1.0, rows.text_bytes / total) if total else counts.documents_read / src.total


