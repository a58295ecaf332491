"""Conversations and prompt-completion pairs -> token ids + a trained mask, built segment by segment.

A rendered example is a list of `Segment`s: template text, message text, or a special token (by
name), each marked trained or not. Tokenising it (`tokenize_segments`) encodes every run of text
between two special tokens in one piece, exactly as tokenising the whole rendered string at once
would (special tokens are hard boundaries for the BPE), and marks a token trained when any byte of
it lies in a trained segment. Message text is always encoded as ordinary text, so a message holding
"<|im_end|>" cannot inject the special token.

The format without a checkpoint template, and for a checkpoint that ships Qwen3's own template, is
Qwen3's ChatML written here byte for byte as that template renders it: `<|im_start|>ROLE\\n ...
<|im_end|>\\n` turns, tool calls in <tool_call> tags, tool results grouped into one user turn in
<tool_response> tags, reasoning in a <think> block. With assistant_only_loss it is TRL's training
variant (every assistant turn keeps its think block), and an assistant turn's trained part is
everything after its `<|im_start|>assistant\\n` header up to and including its <|im_end|> and the newline
after it (TRL's mask for Qwen3). A checkpoint's other templates are rendered by data/chat_template.py.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
ROLES = ("system", "user", "assistant", "tool")
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")  # where datasets keep the thought


@dataclass(frozen=True)
class Segment:
    text: str  # for a special token: its name, e.g. "<|im_end|>"
    trained: bool
    special: bool = False
    role: str = ""  # the message role it came from ("" for template text)


# ---------------------------------------------------------------- message checks
def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, None (empty) or a list of {"type": "text", "text"} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise ConfigError(f"{where}: content part {str(part)[:80]!r} is not text; only "
                                  f"{{'type': 'text', 'text': ...}} parts can be trained on")
        return "".join(parts)
    raise ConfigError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


def _tool_call_json(call: Any, where: str) -> str:
    """One tool call as Qwen3 writes it: {"name": "NAME", "arguments": ...}, the name as given and the
    arguments as given when they are a JSON string, else as JSON."""
    fn = call.get("function") or call if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ConfigError(f"{where}: a tool call must be {{'function': {{'name': str, 'arguments': ...}}}} "
                          f"or {{'name': str, 'arguments': ...}}, got {str(call)[:120]!r}")
    args = fn.get("arguments", {})
    _check_arguments(args, fn["name"], where)
    args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return '{"name": "' + fn["name"] + '", "arguments": ' + args_text + "}"


def _check_arguments(args: Any, name: Any, where: str) -> None:
    """A tool call's arguments given as a string are written as given: they must be JSON, else the model
    would be trained on a broken call."""
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            raise ConfigError(f"{where}: tool call {name!r} has arguments {args[:80]!r}, a string that is not JSON; "
                              f"write them as a mapping or a JSON string (or fix or remove the example)") from None


def message_problem(m: Any) -> str:
    """What is wrong with a message that is not a {role, content} mapping, and the fix."""
    if isinstance(m, dict):
        keys = ", ".join(map(str, m)) or "none"
        return f"it has no `role` (keys: {keys}); give each message a role ({', '.join(ROLES)})"
    return f"it is not a {{role, content}} mapping but {type(m).__name__} {str(m)[:80]!r}"


def check_messages(messages: Any, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: messages must be a non-empty list of {{role, content}} mappings")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ConfigError(f"{where}, message {i}: {message_problem(m)}")
        if m["role"] not in ROLES:
            raise ConfigError(f"{where}: message {i} has role {m['role']!r}; accepted roles are "
                              f"{', '.join(ROLES)}")
    return messages


def normalize_messages(messages: Any, where: str, empty: str | None = "") -> list[dict]:
    """Copies of the messages as every template expects them: content a string (text parts joined; None
    becomes `empty`), and the reasoning under `reasoning_content` when the data names it `reasoning` or
    `thinking`. Done before any template sees them, so no template drops a message's text."""
    out = []
    for i, m in enumerate(check_messages(messages, where)):
        m = dict(m)
        content = m.get("content")
        m["content"] = empty if content is None else _text_of(content, f"{where}, message {i}")
        for call in m.get("tool_calls") or []:  # every template path, not only Qwen3's
            fn = call.get("function") or call if isinstance(call, dict) else None
            if isinstance(fn, dict):
                _check_arguments(fn.get("arguments"), fn.get("name"), f"{where}, message {i}")
        if not isinstance(m.get("reasoning_content"), str):
            alt = next((m[k] for k in REASONING_KEYS[1:] if isinstance(m.get(k), str)), None)
            if alt is not None:
                m["reasoning_content"] = alt
        out.append(m)
    return out


# ---------------------------------------------------------------- Qwen3 rendering
def _nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


def _tools_block(tools: list) -> str:
    """Qwen3's tools section of the system turn: its instructions, the signatures one JSON line each."""
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
            "with function signatures within <tools></tools> XML tags:\n<tools>" + lines + "\n</tools>\n\nFor "
            "each function call, return a json object with function name and arguments within "
            '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call>")


def _last_query(msgs: list[dict]) -> int:
    """Index of the last user message that is a query (not a wrapped tool response); the last index if none."""
    for k in range(len(msgs) - 1, -1, -1):
        c = msgs[k]["content"]
        if msgs[k]["role"] == "user" and not (c.startswith("<tool_response>") and c.endswith("</tool_response>")):
            return k
    return len(msgs) - 1


def split_reasoning(m: dict) -> tuple[str, str]:
    """(reasoning, content) of a normalised assistant message: `reasoning_content`, else a <think>...</think>
    written at the start of the content (taken out of it)."""
    content = m["content"]
    if isinstance(m.get("reasoning_content"), str):
        return m["reasoning_content"], content
    if "</think>" in content:
        head, _, _ = content.partition("</think>")
        return head.rstrip("\n").split("<think>")[-1].lstrip("\n"), content.split("</think>")[-1].lstrip("\n")
    return "", content


def render_qwen3(messages: list[dict], tools: list | None, assistant_only: bool, where: str = "conversation",
                 train_all: bool | None = None, add_generation_prompt: bool = False,
                 every_think: bool | None = None) -> list[Segment]:
    """The conversation as Qwen3 ChatML segments, byte for byte what Qwen3's chat template renders.

    every_think (default: assistant_only) renders the training variant, as TRL trains Qwen3 with
    assistant_only_loss: every assistant turn opens with its think block (empty when it has no reasoning).
    Without it, as Qwen3's template: only the turns after the last user query carry their think block (the
    last turn always, the others when they have reasoning). trained = the assistant turns after their
    header through the newline after its <|im_end|> (assistant_only) or every segment (train_all, default:
    not assistant_only)."""
    everything = (not assistant_only) if train_all is None else train_all
    every_think = assistant_only if every_think is None else every_think
    segs: list[Segment] = []

    def add(text: str, trained: bool, role: str = "") -> None:
        if text:
            segs.append(Segment(_nfc(text), trained or everything, False, role))

    def special(name: str, trained: bool) -> None:
        segs.append(Segment(name, trained or everything, True))

    msgs = normalize_messages(messages, where)
    first_system = msgs[0]["role"] == "system"
    if tools or first_system:
        special(IM_START, False)
        add("system\n", False)
        if first_system:
            add(msgs[0]["content"], False, "system")
        if tools:
            add("\n\n" if first_system else "", False)
            add(_tools_block(tools), False)
        special(IM_END, False)
        add("\n", False)
    last_query, last = _last_query(msgs), len(msgs) - 1
    for i, m in enumerate(msgs):
        role, at = m["role"], f"{where}, message {i}"
        if i == 0 and first_system:
            continue
        if role == "tool":  # consecutive tool results share one user turn
            if i == 0 or msgs[i - 1]["role"] != "tool":
                special(IM_START, False)
                add("user", False)
            add("\n<tool_response>\n", False)
            add(m["content"], False, "tool")
            add("\n</tool_response>", False)
            if i == last or msgs[i + 1]["role"] != "tool":
                special(IM_END, False)
                add("\n", False)
            continue
        special(IM_START, False)
        add(role + "\n", False)
        if role != "assistant":
            add(m["content"], False, role)
            special(IM_END, False)
            add("\n", False)
            continue
        reasoning, content = split_reasoning(m)
        if every_think or (i > last_query and (i == last or reasoning)):
            add("<think>\n", True)
            add(reasoning.strip("\n"), True, "assistant")
            add("\n</think>\n\n", True)
            add(content.lstrip("\n"), True, "assistant")
        else:
            add(content, True, "assistant")
        for j, call in enumerate(m.get("tool_calls") or []):
            add("\n" if (j or content) else "", True)
            add("<tool_call>\n", True)
            add(_tool_call_json(call, at), True, "assistant")
            add("\n</tool_call>", True)
        special(IM_END, True)
        add("\n", True)  # the newline after a turn's <|im_end|> is trained with it, as TRL trains Qwen3
    if add_generation_prompt:
        special(IM_START, False)
        add("assistant\n", False)
    return segs


def render_prompt_completion(prompt: Any, completion: Any, tools: list | None, completion_only: bool,
                             eos_name: str, where: str) -> list[Segment]:
    """Prompt then completion: strings (then eos, trained with the completion, as TRL appends it) or
    message lists (rendered together, as Qwen3's template renders the whole conversation; the completion
    starts after the assistant header that the prompt's generation prompt ends with)."""
    if isinstance(prompt, str) and isinstance(completion, str):
        return [Segment(_nfc(prompt), not completion_only, False, "prompt"),
                Segment(_nfc(completion), True, False, "completion"), Segment(eos_name, True, True)]
    if isinstance(prompt, list) and isinstance(completion, list):
        head = render_qwen3(prompt, tools, False, f"{where} (prompt)", add_generation_prompt=True)
        full = render_qwen3(check_messages(prompt, where) + check_messages(completion, where), tools, False, where,
                            every_think=False)
        n = len(head)
        if [(s.text, s.special) for s in full[:n]] != [(s.text, s.special) for s in head]:
            raise ConfigError(f"{where}: the prompt renders differently once the completion follows it (a user "
                              f"query in the completion); put the whole exchange in `messages` instead")
        return [Segment(s.text, not completion_only, s.special, s.role or "prompt") for s in full[:n]] + \
            [Segment(s.text, True, s.special, s.role or "completion") for s in full[n:]]
    raise ConfigError(f"{where}: prompt and completion must both be strings or both be message lists, got "
                      f"{type(prompt).__name__} and {type(completion).__name__}")


# ---------------------------------------------------------------- tokenising
def tokenize_segments(segments: list[Segment], tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [n], trained bool [n]) of the segments: each run of text between special tokens is
    encoded whole, and a token is trained when any of its bytes belongs to a trained segment."""
    ids: list[int] = []
    mask: list[bool] = []
    run: list[Segment] = []

    def flush() -> None:
        if not run:
            return
        text = "".join(s.text for s in run)
        toks, starts, ends = tokenizer.encode_with_byte_spans(text)
        # trained[b] for every byte b of the run
        per_byte = np.concatenate([np.full(len(s.text.encode("utf-8")), s.trained, bool) for s in run])
        trained_prefix = np.concatenate([[0], np.cumsum(per_byte)])
        ids.extend(toks)
        mask.extend((trained_prefix[ends] - trained_prefix[starts] > 0).tolist())
        run.clear()

    for s in segments:
        if s.special:
            flush()
            ids.append(tokenizer.special_token_id(s.text))
            mask.append(s.trained)
        else:
            run.append(s)
    flush()
    return np.asarray(ids, np.int32), np.asarray(mask, bool)


def render_text(segments: list[Segment]) -> str:
    """The rendered string (special tokens written out)."""
    return "".join(s.text for s in segments)
