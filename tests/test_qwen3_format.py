"""Qwen3's format: the built-in rendering against Qwen3's shipped template (the shared fixture, rendered by
transformers' Jinja), our own exported template, and TRL's training variant with its assistant mask.

Random conversations cover: a system turn or none, tools or none, tool calls with mapping and string
arguments, one or several consecutive tool results, reasoning in `reasoning_content` and inside `content`,
several user queries, an empty or null content, a later system turn. The fixture's tests skip when the
fixture is absent; the TRL comparison skips when TRL is not installed.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from tests.qwen3_checkpoint import qwen3_template_or_skip, write_qwen3_tokenizer
from ulysses_trainer.data.chat import render_qwen3, render_text, tokenize_segments
from ulysses_trainer.data.qwen3_template import QWEN3_CHAT_TEMPLATE, is_qwen3_template

WORDS = ["alpha", "café", "東京", "naïve", "🌍", "x", "  ", "\n", "{", "}", "ß", '"q"', "7", "ok.", "—", "\\"]


def _phrase(rng: random.Random, tag: str) -> str:
    return tag + " " + "".join(rng.choice(WORDS) + rng.choice(["", " "]) for _ in range(rng.randint(0, 8)))


def _assistant(rng: random.Random, tag: str) -> dict:
    a = {"role": "assistant", "content": rng.choice([_phrase(rng, tag), _phrase(rng, tag), "", None])}
    r = rng.random()
    if r < 0.3:
        a["reasoning_content"] = rng.choice(["\n", ""]) + _phrase(rng, "THK" + tag) + rng.choice(["\n", ""])
    elif r < 0.45:
        a["content"] = f"<think>\n{_phrase(rng, 'INLINE' + tag)}\n</think>\n\n" + (a["content"] or "")
    elif r < 0.5:
        a["reasoning_content"] = ""
    return a


def random_conversation(rng: random.Random, n: int) -> tuple[list[dict], list | None]:
    msgs: list[dict] = [{"role": "system", "content": _phrase(rng, f"SYS{n}")}] if rng.random() < 0.5 else []
    for t in range(rng.randint(1, 4)):
        msgs.append({"role": "user", "content": _phrase(rng, f"USR{n}x{t}")})
        for step in range(rng.randint(0, 2)):
            a = _assistant(rng, f"{n}x{t}x{step}")
            k = rng.randint(1, 3)
            a["tool_calls"] = [
                {"type": "function", "function": {"name": f"tool{j}", "arguments": {"q": _phrase(rng, "ARG"), "n": j}}}
                if rng.random() < 0.5 else {"name": f"tool{j}", "arguments": json.dumps({"p": _phrase(rng, "S")})}
                for j in range(k)]
            msgs.append(a)
            msgs += [{"role": "tool", "content": _phrase(rng, f"TOOL{n}x{t}x{j}")} for j in range(k)]
        msgs.append(_assistant(rng, f"{n}x{t}"))
        if rng.random() < 0.05:
            msgs.append({"role": "system", "content": _phrase(rng, "LATE")})
    if rng.random() < 0.2:
        msgs.pop()  # ends on a tool result or a user turn
    tools = [{"type": "function", "function": {"name": f"tool{j}", "description": _phrase(rng, "D"),
                                               "parameters": {"type": "object"}}} for j in range(rng.randint(1, 2))] \
        if rng.random() < 0.5 else None
    return msgs, tools


CONVERSATIONS = [random_conversation(random.Random(7), n) for n in range(80)]


@pytest.fixture(scope="module")
def fixture_template() -> str:
    return qwen3_template_or_skip()


@pytest.fixture(scope="module")
def qwen3_tok(tmp_path_factory, fixture_template):
    """A Qwen3 checkpoint's tokenizer (HF, Qwen3's added tokens and eos) carrying Qwen3's shipped template."""
    from ulysses_trainer.data.tokenizer import load_tokenizer

    return load_tokenizer(str(write_qwen3_tokenizer(tmp_path_factory.mktemp("qwen3_tok"), fixture_template)))


def test_fixture_is_recognised_and_nothing_else(fixture_template):
    assert is_qwen3_template(fixture_template) and is_qwen3_template({"default": fixture_template})
    assert not is_qwen3_template(fixture_template + "\n") and not is_qwen3_template(QWEN3_CHAT_TEMPLATE)


@pytest.mark.parametrize("generation_prompt", [False, True])
def test_builtin_format_equals_qwen3_template_strings_and_ids(qwen3_tok, fixture_template, generation_prompt):
    """>= 50 random conversations: the built-in format (inference rendering), Qwen3's template and our exported
    template write the same string, and the built-in segments tokenise to the template's token ids."""
    hf = qwen3_tok.hf_tokenizer
    think_blocks = 0
    for n, (msgs, tools) in enumerate(CONVERSATIONS):
        segs = render_qwen3(msgs, tools, False, add_generation_prompt=generation_prompt)
        ours = render_text(segs)
        want = hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=generation_prompt,
                                      chat_template=fixture_template)
        assert ours == want, (n, ours, want)
        exported = hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=generation_prompt,
                                          chat_template=QWEN3_CHAT_TEMPLATE)
        assert exported == want, (n, exported, want)
        ids, _ = tokenize_segments(segs, qwen3_tok)
        assert ids.tolist() == hf(want, add_special_tokens=False)["input_ids"], n
        think_blocks += want.count("<think>")
    assert think_blocks > 20  # the conversations exercise the think-block rules


def test_list_of_parts_renders_as_string_content(qwen3_tok, fixture_template, tmp_path):
    """Text parts are joined before any template sees them: the recognised Qwen3 template (built-in path), the
    built-in format with the Qwen BPE, and an unrecognised template give the tokens of string content."""
    from ulysses_trainer.data.chat_template import TemplateRenderer
    from ulysses_trainer.data.documents import chat_template_of
    from ulysses_trainer.data.qwen_bpe import QwenBPETokenizer
    from ulysses_trainer.data.tokenizer import load_tokenizer

    def parts(text):
        cut = len(text) // 2
        return [{"type": "text", "text": text[:cut]}, {"type": "text", "text": text[cut:]}]

    other = load_tokenizer(str(write_qwen3_tokenizer(tmp_path / "other", fixture_template.replace(
        "{%- if add_generation_prompt %}", "{#- edited -#}{%- if add_generation_prompt %}"))))
    assert chat_template_of(qwen3_tok) is None  # recognised: the built-in format renders it
    assert isinstance(chat_template_of(other), TemplateRenderer)
    bpe = QwenBPETokenizer()
    for msgs, tools in CONVERSATIONS[:20]:
        as_parts = [dict(m, content=parts(m["content"])) if isinstance(m.get("content"), str) else m for m in msgs]
        for assistant_only in (True, False):
            a = tokenize_segments(render_qwen3(msgs, tools, assistant_only), qwen3_tok)
            b = tokenize_segments(render_qwen3(as_parts, tools, assistant_only), qwen3_tok)
            assert all(np.array_equal(x, y) for x, y in zip(a, b))
            a = tokenize_segments(render_qwen3(msgs, tools, assistant_only), bpe)
            b = tokenize_segments(render_qwen3(as_parts, tools, assistant_only), bpe)
            assert all(np.array_equal(x, y) for x, y in zip(a, b))
        a = tokenize_segments(chat_template_of(other).conversation(msgs, tools, False, "x"), other)[0]
        b = tokenize_segments(chat_template_of(other).conversation(as_parts, tools, False, "x"), other)[0]
        assert np.array_equal(a, b)
        assert a.tolist() == other.hf_tokenizer.apply_chat_template(msgs, tools=tools, tokenize=True,
                                                                    return_dict=False)


def test_training_variant_keeps_every_think_block(qwen3_tok):
    """assistant_only_loss renders every assistant turn with its think block, and the rendering of the
    conversation so far is a prefix of the rendering of the whole one (prefix-preserving) at every turn."""
    for msgs, tools in CONVERSATIONS:
        full = render_text(render_qwen3(msgs, tools, True))
        assert full.count("<|im_start|>assistant\n<think>\n") == sum(m["role"] == "assistant" for m in msgs)
        for k in range(1, len(msgs)):
            if msgs[k]["role"] == "tool" and msgs[k - 1]["role"] == "tool":
                continue  # consecutive tool results share one turn: the cut is inside it
            assert full.startswith(render_text(render_qwen3(msgs[:k], tools, True))), k


def test_trained_text_equals_trl_training_rendering(qwen3_tok, tmp_path):
    """Through the data path (a dataset file, the checkpoint's tokenizer with Qwen3's template,
    assistant_only_loss): the token ids equal TRL's training rendering (get_training_chat_template) tokenised,
    and the trained tokens equal TRL's assistant mask token for token, the newline after each assistant
    <|im_end|> included (docs/conversations.md)."""
    trl_utils = pytest.importorskip("trl.chat_template_utils")
    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.data.documents import build_sequences
    from ulysses_trainer.parallel.sharding import IGNORE_INDEX

    hf = qwen3_tok.hf_tokenizer
    training = trl_utils.get_training_chat_template(hf)
    assert training is not None and "{% generation %}" in training.replace("{%- generation %}", "{% generation %}")
    path = tmp_path / "conv.jsonl"
    path.write_text("".join(json.dumps({"messages": m, "tools": json.dumps(t) if t else None}) + "\n"
                            for m, t in CONVERSATIONS))
    ds = build_sequences(TrainConfig(dataset_name=str(path), max_length=4096, assistant_only_loss=True), qwen3_tok)
    assert len(ds) == len(CONVERSATIONS)
    newline, im_end = hf.convert_tokens_to_ids("Ċ"), hf.convert_tokens_to_ids("<|im_end|>")
    for i, (msgs, tools) in enumerate(CONVERSATIONS):
        text = hf.apply_chat_template(msgs, tools=tools, tokenize=False, chat_template=training)
        out = hf.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=True, chat_template=training,
                                     return_assistant_tokens_mask=True)
        ids, trl_mask = out["input_ids"], np.asarray(out["assistant_masks"], bool)
        row, n = ds[i], ds.real_tokens(i)
        assert row["input_ids"][:n].tolist() == ids, i
        assert hf.decode(ids) == text
        ours = np.zeros(n, bool)
        ours[1:] = (row["labels"][:n] != IGNORE_INDEX).numpy()[1:]  # labels are unshifted: label[t] = ids[t]
        trl_mask[0] = False  # the first token is nobody's target
        assert ours.tolist() == trl_mask.tolist(), i
        ends = np.flatnonzero((np.asarray(ids) == im_end) & ours)
        assert len(ends) == sum(m["role"] == "assistant" for m in msgs)
        assert all(ids[e + 1] == newline and ours[e + 1] for e in ends)  # the newline after each turn, trained
