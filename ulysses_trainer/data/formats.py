"""TRL SFTTrainer's dataset types, detected per dataset from its columns, and each example's segments.

  language_modeling   a text column (`text`, or dataset_text_field): documents joined end to end
  conversational      `messages` (roles system / user / assistant / tool; assistant `tool_calls` and
                      reasoning), optional `tools` column
  prompt_completion   `prompt` + `completion`: both strings, or both message lists

Anything else is a ConfigError naming what was found and what is accepted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..errors import ConfigError
from .accounting import DROPPED_SPECIAL_TEXT, UNENCODABLE_SPECIAL_TEXT, DataCounts
from .chat import Segment, message_problem, render_prompt_completion, render_qwen3
from .chat_template import TemplateRenderer, UnencodableSpecialText

LANGUAGE_MODELING, CONVERSATIONAL, PROMPT_COMPLETION = "language_modeling", "conversational", "prompt_completion"
ACCEPTED = ("a text column (`text`, or the column named by dataset_text_field); `messages` (conversational: "
            "a list of {role, content}, optional `tools`); or `prompt` + `completion` (strings or message lists)")


def detect_format(columns: list[str], text_field: str, source: str) -> str:
    """The dataset's type, TRL's way: messages, else prompt + completion, else the text column."""
    cols = set(columns)
    if "messages" in cols:
        return CONVERSATIONAL
    if "prompt" in cols and "completion" in cols:
        if text_field in ("prompt", "completion"):  # training on one column would drop the other half
            raise ConfigError(f"dataset {source} is prompt-completion (fields `prompt` and `completion`), which "
                              f"trains on both; dataset_text_field {text_field!r} would drop the other one. "
                              f"Remove dataset_text_field (completion_only_loss chooses what is trained)")
        return PROMPT_COMPLETION
    if "prompt" in cols or "completion" in cols:
        has, lacks = ("prompt", "completion") if "prompt" in cols else ("completion", "prompt")
        raise ConfigError(f"dataset {source} has a `{has}` field but no `{lacks}` field (fields: {sorted(cols)}); "
                          f"a prompt-completion dataset needs both. Accepted: {ACCEPTED}")
    if text_field in cols:
        return LANGUAGE_MODELING
    raise ConfigError(f"dataset {source} has no field {text_field!r}; its fields are {sorted(cols)}, none of the "
                      f"accepted forms. Accepted: {ACCEPTED}")


def _tools_of(row: dict, where: str) -> list | None:
    tools = row.get("tools")
    if tools is None:
        return None
    if isinstance(tools, str):  # datasets often store the tool list as a JSON string
        import json

        try:
            tools = json.loads(tools)
        except ValueError:
            raise ConfigError(f"{where}: `tools` is a string that is not JSON") from None
    if not isinstance(tools, list):
        raise ConfigError(f"{where}: `tools` must be a list of function signatures, got {type(tools).__name__}")
    return tools or None


NO_MESSAGES = "without `messages` (a row of another shape)"
NO_PROMPT_COMPLETION = "without `prompt` or `completion` (a row of another shape)"


ENCODE, DROP = "encode", "drop"  # special_text's values


@dataclass(frozen=True)
class SpecialTextPolicy:
    """What becomes of an example whose text holds a special token's string (the special_text setting): ENCODE
    (the string as ordinary text; both renderings do so) or DROP. texts: the tokenizer's special strings."""

    mode: str
    texts: tuple[str, ...]

    @cached_property
    def _pattern(self) -> re.Pattern:
        return re.compile("|".join(re.escape(t) for t in self.texts))

    def held(self, value: Any) -> bool:
        """Whether any string in `value` (a message list, a prompt, a mapping of them) holds one of the texts."""
        if not self.texts:
            return False
        pattern = self._pattern
        stack = [value]
        while stack:
            v = stack.pop()
            if isinstance(v, str):
                if pattern.search(v):
                    return True
            elif isinstance(v, dict):
                stack.extend(v.values())
            elif isinstance(v, list):
                stack.extend(v)
        return False


def example_segments(kind: str, rows: Iterator[dict], source: str, assistant_only_loss: bool,
                     completion_only_loss: bool | None, eos_name: str,
                     template: TemplateRenderer | None = None,
                     skipped: dict[str, int] | None = None, start: int = 0,
                     special: SpecialTextPolicy | None = None,
                     tally: DataCounts | None = None) -> Iterator[list[Segment]]:
    """One segment list per example (conversational or prompt-completion); messages are rendered with the
    checkpoint's chat template when `template` is given, else in Qwen3's format. A row of another shape (a
    `text` row in a `messages` file: its `messages` is null) is left out and counted in `skipped` by reason.
    start: the number of the first row (in messages naming an example). special: an example whose text holds a
    special token's string is counted in `tally.special_text` and, under DROP, left out (a skip reason); under
    ENCODE it renders with the string as text."""
    skipped = {} if skipped is None else skipped

    def skip(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    for n, row in enumerate(rows, start):
        where = f"dataset {source}, example {n}"
        if kind == CONVERSATIONAL:
            if row.get("messages") is None:
                skip(NO_MESSAGES)
                continue
        elif row.get("prompt") is None or row.get("completion") is None:
            skip(NO_PROMPT_COMPLETION)
            continue
        fields = row.get("messages") if kind == CONVERSATIONAL else [row["prompt"], row["completion"]]
        if special is not None and special.held(fields):
            if tally is not None:
                tally.special_text += 1
            if special.mode == DROP:
                skip(DROPPED_SPECIAL_TEXT)
                continue
        try:
            segments = _render(kind, row, where, assistant_only_loss, completion_only_loss, eos_name, template)
        except UnencodableSpecialText:  # its text could not be told apart from the stand-ins: left out, counted
            skip(UNENCODABLE_SPECIAL_TEXT)
            continue
        yield segments


def _render(kind: str, row: dict, where: str, assistant_only_loss: bool, completion_only_loss: bool | None,
            eos_name: str, template: TemplateRenderer | None) -> list[Segment]:
    """One example's segments (see example_segments)."""
    if kind == CONVERSATIONAL:
        tools = _tools_of(row, where)
        return template.conversation(row["messages"], tools, assistant_only_loss, where) if template else \
            render_qwen3(row["messages"], tools, assistant_only_loss, where)
    if template is not None and isinstance(row["prompt"], list) and isinstance(row["completion"], list):
        return template.prompt_completion(row["prompt"], row["completion"], _tools_of(row, where),
                                          completion_only_loss is not False, where)
    return render_prompt_completion(row["prompt"], row["completion"], _tools_of(row, where),
                                    completion_only_loss is not False, eos_name, where)


def check_loss_flags(kind: str, assistant_only_loss: bool, source: str) -> None:
    if assistant_only_loss and kind != CONVERSATIONAL:
        raise ConfigError(f"assistant_only_loss needs a conversational dataset (`messages`); dataset {source} is "
                          f"{kind.replace('_', '-')}. Set assistant_only_loss false"
                          + (" (completion_only_loss trains on the completion)" if kind == PROMPT_COMPLETION else ""))


def check_settings_for_kind(kind: str, cfg: Any, source: str, template: TemplateRenderer | None,
                            first: dict | None = None) -> None:
    """Settings with no effect on this kind of data are refused (never accepted and ignored): once the data's
    kind is known, before any model is built. first: the first example (prompt-completion pairs of message
    lists are rendered as conversations are)."""
    what = f"dataset {source} is {kind.replace('_', '-')}"
    messages = kind == CONVERSATIONAL or kind == PROMPT_COMPLETION and isinstance((first or {}).get("prompt"), list)
    if cfg.completion_only_loss is not None and kind != PROMPT_COMPLETION:
        other = " (assistant_only_loss chooses what a conversation trains on)" if kind == CONVERSATIONAL else ""
        raise ConfigError(f"completion_only_loss has no effect here: it chooses what prompt-completion pairs train "
                          f"on, and {what}; remove completion_only_loss{other}")
    if cfg.dataset_text_field != "text" and kind != LANGUAGE_MODELING:
        raise ConfigError(f"dataset_text_field {cfg.dataset_text_field!r} has no effect here: it names the text "
                          f"column of text data, and {what} (read from its `messages` or `prompt` + `completion`); "
                          f"remove dataset_text_field")
    if cfg.eos_token is not None and messages:
        if template is None and cfg.eos_token != "<|im_end|>":
            raise ConfigError(f"eos_token {cfg.eos_token!r} has no effect here: {what} of messages, rendered in "
                              f"Qwen3's format, whose turns end with <|im_end|>; remove eos_token (or give a chat "
                              f"template that writes eos_token: chat_template_path)")
        if template is not None and "eos_token" not in str(template.tok.chat_template):
            raise ConfigError(f"eos_token {cfg.eos_token!r} has no effect here: {what} of messages, and its chat "
                              f"template never writes eos_token; remove eos_token")


def check_first_example(kind: str, row: dict, source: str) -> None:
    """The first example's shape, so a wrong column type fails before any tokenising."""
    where = f"dataset {source}, example 0"
    if kind == CONVERSATIONAL:
        msgs = row.get("messages")
        if not isinstance(msgs, list):
            raise ConfigError(f"{where}: `messages` must be a list of {{role, content}} mappings, got "
                              f"{str(msgs)[:100]!r}. Accepted: {ACCEPTED}")
        for i, m in enumerate(msgs):  # the message at fault, not only its example
            if not isinstance(m, dict) or "role" not in m:
                raise ConfigError(f"{where}, message {i}: {message_problem(m)}")
    elif kind == PROMPT_COMPLETION:
        p, c = row.get("prompt"), row.get("completion")
        if not (isinstance(p, str) and isinstance(c, str)) and not (isinstance(p, list) and isinstance(c, list)):
            raise ConfigError(f"{where}: prompt and completion must both be strings or both be message lists, "
                              f"got {type(p).__name__} and {type(c).__name__}")


def rows_of(ds: Any) -> Iterator[dict]:
    for batch in ds.iter(batch_size=64):
        keys = list(batch)
        for i in range(len(batch[keys[0]]) if keys else 0):
            yield {k: batch[k][i] for k in keys}
