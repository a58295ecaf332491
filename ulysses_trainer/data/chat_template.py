"""A checkpoint's own chat template (any but Qwen3's shipped one): its rendering and its trained spans.

The conversation is rendered by the template (apply_chat_template, tools passed through). A shipped template that
TRL swaps for a training variant with assistant_only_loss (data/training_templates.py) renders those
conversations with that variant, whose generation markers give the trained spans. With assistant_only_loss the
trained spans are found, first rule that applies:

  generation markers  the template wraps the assistant's output in {% generation %} ... {% endgeneration %}:
                      exactly the marked tokens (apply_chat_template's assistant mask, as TRL trains)
  ChatML turns        the template writes `<|im_start|>assistant\\n ... <|im_end|>` (both special tokens): the
                      conversation is rendered once and each assistant turn found by structure, trained from
                      after its header through its <|im_end|> and the newline after it (the built-in format's
                      rule). A template that rewrites earlier turns (drops old reasoning) trains each turn as
                      it renders it in the whole conversation.
  prefixes            assistant turn k spans from the end of messages[:k] rendered with the generation prompt
                      to the end of messages[:k+1] (its end token and the whitespace after it included). Only a
                      template that renders earlier turns the same whatever follows can be cut this way; any
                      other is refused for assistant_only_loss.

Message text holding one of the tokenizer's special-token strings (`<|im_end|>` in a file a tool read) stays text:
each such string goes to the template as a private-use character of its own (U+F0000 + its index) and comes back as
the string in a text segment, so it is encoded as ordinary text and the special token's id appears only where the
template wrote it (a literal could otherwise forge a turn). data/formats.py counts such examples, or drops them
(special_text drop).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from ..errors import ConfigError
from .chat import IM_END, IM_START, Segment, normalize_messages

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")  # TRL's test for markers (trim variants too)
ASSISTANT_TURN = re.compile(re.escape(IM_START) + "assistant\n(.*?)" + re.escape(IM_END) + "\n?", re.DOTALL)
MARKERS, CHATML, PREFIXES = "generation markers", "ChatML turns", "prefixes"
# a template that writes each argument of a tool call (Qwen3.5's XML `<parameter=NAME>`) renders only a mapping
ARGUMENTS_BY_NAME = re.compile(r"arguments\s*\|\s*items")


def template_text(template: Any) -> str:
    """The template's source (a dict of named templates: its default)."""
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else ""


_STANDIN = 0xF0000  # the first private-use character standing in for a special token's string in message text
_STANDINS = re.compile("[\U000F0000-\U000FFFFD]")


class UnencodableSpecialText(ConfigError):
    """Message text holding a special token's string and the private-use characters that would stand in for it."""


class TemplateRenderer:
    """Segments of conversations and prompt-completion pairs rendered by the checkpoint's chat template; `rule`
    says how its assistant turns are found (MARKERS, CHATML or PREFIXES, see the module doc). training: the
    template's training variant (data/training_templates.py), which renders the conversations of assistant_only_loss
    in its place; its generation markers say what is trained."""

    def __init__(self, hf_tokenizer: Any, name: str, training: str | None = None) -> None:
        self.tok, self.name, self.training = hf_tokenizer, name, training
        self.arguments_by_name = bool(ARGUMENTS_BY_NAME.search(template_text(hf_tokenizer.chat_template)))
        specials = sorted({t.content for t in hf_tokenizer.added_tokens_decoder.values() if t.special}, key=len,
                          reverse=True)
        self.specials = specials
        self._split = re.compile("(" + "|".join(re.escape(s) for s in specials) + ")") if specials else None
        self._standin = {s: chr(_STANDIN + i) for i, s in enumerate(specials)}  # message text -> template
        self._restore = {_STANDIN + i: s for i, s in enumerate(specials)}  # rendering -> text
        source = template_text(hf_tokenizer.chat_template)
        if GENERATION_TAG.search(source):
            self.rule = MARKERS
        elif all(t in specials and t in source for t in (IM_START, IM_END)):
            self.rule = CHATML
        else:
            self.rule = PREFIXES

    def _apply(self, msgs: list[dict], tools: list | None, template: str | None = None, **kwargs: Any) -> Any:
        if template is not None:
            kwargs["chat_template"] = template
        try:
            return self.tok.apply_chat_template(msgs, tools=tools, **kwargs)
        except Exception as exc:  # a template's own raise_exception, or a jinja error
            raise ConfigError(f"the chat template of {self.name} cannot render this conversation: {exc}") from None

    def _render(self, msgs: list[dict], tools: list | None, generation_prompt: bool,
                template: str | None = None) -> str:
        return self._apply(msgs, tools, template, tokenize=False, add_generation_prompt=generation_prompt)

    def _hide_specials(self, value: Any, where: str) -> tuple[Any, bool]:
        """(value with every special token's string in its text replaced by its stand-in, whether any was). Text
        that already holds a stand-in character cannot be told apart after rendering: UnencodableSpecialText."""
        if isinstance(value, str):
            if self._split is None or not self._split.search(value):
                return value, False
            if _STANDINS.search(value):
                raise UnencodableSpecialText(f"{where}: message text holds a special token's string and private-use "
                                             f"characters (U+F0000..U+FFFFD) that would stand in for it")
            return self._split.sub(lambda m: self._standin[m.group(0)], value), True
        if isinstance(value, dict):
            pairs = [(k, self._hide_specials(v, where)) for k, v in value.items()]
            return {k: v for k, (v, _) in pairs}, any(h for _, (_, h) in pairs)
        if isinstance(value, list):
            items = [self._hide_specials(v, where) for v in value]
            return [v for v, _ in items], any(h for _, h in items)
        return value, False

    # ------------------------------------------------------------ the three rules
    def _marked_spans(self, msgs: list[dict], tools: list | None, template: str | None) -> list[tuple[int, int]]:
        """Character spans of the tokens apply_chat_template's assistant mask marks (TRL's call)."""
        out = self._apply(msgs, tools, template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        offsets = out.encodings[0].offsets  # of the same rendering, tokenised by apply_chat_template
        spans: list[tuple[int, int]] = []
        for i in np.flatnonzero(np.asarray(out["assistant_masks"], bool)):
            s, e = offsets[i]
            if spans and s <= spans[-1][1]:  # the next token of the same run
                spans[-1] = (spans[-1][0], max(e, spans[-1][1]))
            else:
                spans.append((s, e))
        return spans

    @staticmethod
    def _turn_spans(full: str) -> list[tuple[int, int]]:
        """Each `<|im_start|>assistant\\n` turn from after its header through its <|im_end|> and newline (message
        text holds no special token, so the first <|im_end|> after the header is the turn's)."""
        return [(m.start(1), m.end()) for m in ASSISTANT_TURN.finditer(full)]

    def _prefix_spans(self, msgs: list[dict], tools: list | None, full: str, where: str) -> list[tuple[int, int]]:
        spans = []
        for k, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            head, upto = self._render(msgs[:k], tools, True), self._render(msgs[:k + 1], tools, False)
            if not (full.startswith(upto) and upto.startswith(head)):
                raise ConfigError(
                    f"{where}, message {k}: the chat template of {self.name} renders earlier turns differently once "
                    f"later turns follow, and it neither writes ChatML turns (<|im_start|>assistant\\n ... "
                    f"<|im_end|>) nor marks the assistant's output with {{% generation %}}, so the trained spans "
                    f"cannot be found; set assistant_only_loss false (every token trained), or give a template that "
                    f"wraps each assistant turn's output in {{% generation %}} ... {{% endgeneration %}}, as TRL's "
                    f"training templates do, with chat_template_path")
            spans.append((len(head), len(upto)))
        return spans

    def _arguments_as_mappings(self, msgs: list[dict], where: str) -> list[dict]:
        """Tool-call arguments given as a JSON string (checked to be JSON) as the mapping it encodes, for a template
        that writes each argument by name and cannot render a string."""
        if not self.arguments_by_name:
            return msgs
        out = []
        for i, m in enumerate(msgs):
            calls = m.get("tool_calls")
            if calls:
                m = dict(m)
                m["tool_calls"] = [self._call_with_mapping(c, f"{where}, message {i}") for c in calls]
            out.append(m)
        return out

    @staticmethod
    def _call_with_mapping(call: Any, where: str) -> Any:
        fn = call.get("function") if isinstance(call, dict) and isinstance(call.get("function"), dict) else call
        if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
            return call
        args = json.loads(fn["arguments"])
        if not isinstance(args, dict):
            raise ConfigError(f"{where}: tool call {fn.get('name')!r} has arguments {fn['arguments'][:80]!r}; the chat "
                              f"template writes each argument by name, so they must be a JSON object")
        if fn is call:  # {"name", "arguments"}
            return {**fn, "arguments": args}
        return {**call, "function": {**fn, "arguments": args}}

    # ------------------------------------------------------------ examples
    def conversation(self, msgs: list[dict], tools: list | None, assistant_only: bool, where: str) -> list[Segment]:
        msgs = self._arguments_as_mappings(normalize_messages(msgs, where, empty=None), where)
        msgs, hidden = self._hide_specials(msgs, where)
        if assistant_only and self.training is not None:  # TRL's training variant: its markers say what is trained
            full = self._render(msgs, tools, False, self.training)
            return self._segments(full, self._marked_spans(msgs, tools, self.training), hidden)
        full = self._render(msgs, tools, False)
        if not assistant_only:
            return self._segments(full, [(0, len(full))], hidden)
        if self.rule == MARKERS:
            return self._segments(full, self._marked_spans(msgs, tools, None), hidden)
        if self.rule == CHATML:
            spans = self._turn_spans(full)
            if len(spans) == sum(m["role"] == "assistant" for m in msgs):
                return self._segments(full, spans, hidden)
            # a turn per assistant message is what the structure means; otherwise the prefixes decide
        return self._segments(full, self._prefix_spans(msgs, tools, full, where), hidden)

    def prompt_completion(self, prompt: list, completion: list, tools: list | None, completion_only: bool,
                          where: str) -> list[Segment]:
        """The pair rendered together; the completion starts where the prompt rendered with the generation
        prompt ends, and is trained to the rendering's end (its last newline included)."""
        prompt = self._arguments_as_mappings(normalize_messages(prompt, where, None), where)
        completion = self._arguments_as_mappings(normalize_messages(completion, where, None), where)
        (prompt, completion), hidden = self._hide_specials([prompt, completion], where)
        full = self._render(prompt + completion, tools, False)
        head = self._render(prompt, tools, True)
        if not full.startswith(head):
            raise ConfigError(f"{where}: the chat template of {self.name} renders the prompt differently once the "
                              f"completion follows it, so the completion's start cannot be found; put the whole "
                              f"exchange in `messages` (assistant_only_loss trains its assistant turns)")
        return self._segments(full, [(len(head) if completion_only else 0, len(full))], hidden)

    def _segments(self, text: str, spans: list[tuple[int, int]], hidden: bool = False) -> list[Segment]:
        """The rendered text cut at special tokens and span edges, each piece marked trained or not; hidden: the
        stand-ins in it are message text's special-token strings, given back as text."""
        trained = np.zeros(len(text) + 1, bool)
        for s, e in spans:
            trained[s:e] = True
        cuts = {0, len(text)} | {i for s, e in spans for i in (s, e)}
        specials = []
        for m in self._split.finditer(text) if self._split else ():
            specials.append((m.start(), m.end()))
            cuts |= {m.start(), m.end()}
        special_at = dict(specials)
        edges = sorted(c for c in cuts if 0 <= c <= len(text))
        segs = []
        for a, b in zip(edges, edges[1:]):
            if a in special_at and special_at[a] == b:
                segs.append(Segment(text[a:b], bool(trained[a]), True))
            elif b > a:
                piece = text[a:b].translate(self._restore) if hidden else text[a:b]
                segs.append(Segment(piece, bool(trained[a]), False))
        return segs
