"""Data preparation at scale: the byte spans without a per-token loop are the per-token loop's, bit for bit."""

from __future__ import annotations

import random

import numpy as np

from ulysses_trainer.data.tokenizer import QwenBPETokenizer, utf8_lengths

ALPHABET = "abc XYZ 012\n\t.,;é漢字日本語🙂🚀 ñü <|im_start|> ِ ́"


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 300))) for _ in range(n)]


def test_utf8_lengths_are_each_characters_encoded_length():
    for text in _texts(50) + ["", "\ud800x"]:  # a lone surrogate counts as Python's surrogatepass bytes
        want = [len(c.encode("utf-8", errors="surrogatepass")) for c in text]
        assert utf8_lengths(text).tolist() == want


def test_qwen_byte_spans_equal_the_per_token_decode():
    tok = QwenBPETokenizer()
    for text in _texts(50, seed=1) + [""]:
        ids, starts, ends = tok.encode_with_byte_spans(text)
        want_ends = np.cumsum([len(tok._enc.decode_single_token_bytes(t)) for t in ids], dtype=np.int64)
        assert ids == tok._enc.encode_ordinary(text)
        assert ends.tolist() == want_ends.tolist()
        assert starts.tolist() == ([0] + want_ends[:-1].tolist() if ids else [])
        assert (ends[-1] if ids else 0) == len(text.encode("utf-8"))
