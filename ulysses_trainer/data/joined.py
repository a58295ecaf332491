"""Text documents joined end to end (each + eos) and cut into rows of max_length tokens: packing false, and
packing_strategy wrapped. With packing the positions restart at every document start and every row start.

Documents are encoded in batches of at most BATCH_DOCS documents or about CHUNK_CHARS of text, in order."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np

from .accounting import DataCounts
from .rows import Rows
from .tokenizer import Tokenizer
from .workers import chunks_of, ordered_map

BATCH_DOCS = 64
CHUNK_CHARS = 1 << 20  # a batch (a worker's share): at most BATCH_DOCS documents or rows, or about this much text


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


def join_and_cut(docs: Iterable[str], tokenizer: Tokenizer, max_length: int, packing: bool,
                 max_rows: int | None, counts: DataCounts | None = None,
                 pad_last: bool = False, num_proc: int | None = None) -> Rows:
    """Whole rows (positions None without packing), stopping at max_rows; counts.tokens: the tokens of the
    documents used. pad_last: the tokens after the last full row become one more row, padded (eos as the pad
    id; its labels are masked). num_proc: tokenizing workers (without max_rows only: workers read ahead, and a
    capped read must stop where its rows are full)."""
    counts = counts if counts is not None else DataCounts()
    chunks: list[np.ndarray] = []
    pos_chunks: list[np.ndarray] = []
    seen = text_bytes = 0
    need = None if max_rows is None else max_rows * max_length
    for batch, encoded in encoded_batches(docs, tokenizer, None if need is not None else num_proc):
        for doc, ids in zip(batch, encoded):
            text_bytes += len(doc.encode("utf-8"))
            row = np.asarray(ids + [tokenizer.eos_token_id], dtype=np.int32)
            chunks.append(row)
            if packing:
                pos_chunks.append(np.arange(len(row), dtype=np.int32))
            seen += len(row)
            counts.take()
            counts.use(len(row))
            if need is not None and seen >= need:
                break  # (the rest of the batch, pulled from the source, is not read)
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
    return Rows(tokens, positions, counts, pad_from=pad_from, text_bytes=text_bytes)
