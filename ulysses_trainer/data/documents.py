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
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..config import TrainConfig
from ..errors import ConfigError
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
from .joined import BATCH_DOCS, CHUNK_CHARS, encoded_batches, join_and_cut
from .loading import load_text_dataset
from .qwen3_5_template import training_variant
from .qwen3_template import is_qwen3_template
from .rows import build_rows
from .sequences import SequenceDataset
from .synthetic import synthetic_documents
from .tokenizer import Tokenizer
from .workers import chunks_of, ordered_map, text_size

_TOKENS_PER_WORD = 1.26  # of the synthetic prose under the Qwen BPE (measured)
_EVAL_SEED_OFFSET = 1_000_003  # synthetic eval documents differ from the training ones
SYNTHETIC_STEPS_PER_EPOCH = 4
AGENT_SESSIONS = "synthetic:agent_sessions"  # dataset_name of the synthetic agent sessions
MIXED_SESSIONS = "synthetic:agent_sessions_mixed"  # ... of mixed lengths (4K-400K tokens, median 60K)
NO_FIELD = "without the text field (missing or null)"
EMPTY = "empty text"


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


# ---------------------------------------------------------------- building
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
        tokens, positions, used, _, _, _ = join_and_cut(_counted(docs, counts), tokenizer, L, cfg.packing, rows, counts)
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
    tokens, positions, used, seen, text_bytes, pad_from = join_and_cut(
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
    """(ids, trained) of each example, rendered and tokenized in order (num_proc: by chunks of BATCH_DOCS rows
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
        for part in chunks_of(rows, BATCH_DOCS, text_size, CHUNK_CHARS):
            yield start, part
            start += len(part)

    for examples, shape in ordered_map(work, numbered(), num_proc):
        for reason, n in shape.items():
            skipped[reason] = skipped.get(reason, 0) + n
        yield from examples


def chat_template_of(tokenizer: Tokenizer) -> TemplateRenderer | None:
    """The checkpoint's own chat template where its tokenizer has one (with TRL's training variant of a shipped
    Qwen3.5-family template, for assistant_only_loss); None: Qwen3's format, built in (also for Qwen3's shipped
    template, which the built-in format renders byte for byte, in TRL's training variant with assistant_only_loss)."""
    hf = getattr(tokenizer, "hf_tokenizer", None)
    template = getattr(hf, "chat_template", None) if hf is not None else None
    if not template or is_qwen3_template(template):
        return None
    return TemplateRenderer(hf, tokenizer.name, training_variant(template))


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
        for batch, encoded in encoded_batches(docs, tokenizer, cfg.dataset_num_proc if num_sequences is None
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
