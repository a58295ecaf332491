"""The built-in tokenizer (the presets') is Qwen3's for its added tokens: `<think>` is 151667, `<tool_call>` 151657,
every added token at Qwen3's id with Qwen3's special flag, 151,669 ids; the exported tokenizer agrees."""

from __future__ import annotations

import pytest

from tests.qwen3_checkpoint import fixtures_dir
from ulysses_trainer.data.chat import render_qwen3, tokenize_segments
from ulysses_trainer.data.qwen_bpe import QwenBPETokenizer

# Qwen3's tokenizer.json (Qwen/Qwen3-8B): written out here, not read from the table the code embeds
NOT_SPECIAL = {"<tool_call>": 151657, "</tool_call>": 151658, "<|fim_prefix|>": 151659, "<|fim_middle|>": 151660,
               "<|fim_suffix|>": 151661, "<|fim_pad|>": 151662, "<|repo_name|>": 151663, "<|file_sep|>": 151664,
               "<tool_response>": 151665, "</tool_response>": 151666, "<think>": 151667, "</think>": 151668}
SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|object_ref_start|>": 151646,
           "<|object_ref_end|>": 151647, "<|box_start|>": 151648, "<|box_end|>": 151649, "<|quad_start|>": 151650,
           "<|quad_end|>": 151651, "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
           "<|image_pad|>": 151655, "<|video_pad|>": 151656}


@pytest.fixture(scope="module")
def tok() -> QwenBPETokenizer:
    return QwenBPETokenizer()


def test_every_added_token_is_at_qwen3s_id(tok):
    assert tok.vocab_size == 151669  # 151,643 BPE ranks + 26 added tokens, as len() of Qwen3's tokenizer
    for text, i in {**SPECIAL, **NOT_SPECIAL}.items():
        assert tok.special_token_id(text) == i, text
        assert tok.decode([i]) == text
    assert tok.eos_token_id == 151643


def test_added_tokens_that_are_not_special_are_one_id_in_text(tok):
    for text, i in NOT_SPECIAL.items():
        assert tok.encode(text) == [i], text
    assert tok.encode("a<think>\nb</think>") == tok.encode("a") + [151667] + tok.encode("\nb") + [151668]
    for text in SPECIAL:  # special tokens stay text: a document cannot inject an <|endoftext|>
        assert len(tok.encode(text)) > 1 and SPECIAL[text] not in tok.encode(text)


def test_the_built_in_format_writes_think_and_tool_call_as_qwen3s_ids(tok):
    conv = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "reasoning_content": "look it up", "content": "",
             "tool_calls": [{"function": {"name": "get", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "rain"}, {"role": "assistant", "content": "It rains."}]
    ids, trained = tokenize_segments(render_qwen3(conv, None, assistant_only=True), tok)
    ids = ids.tolist()
    for text in ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert NOT_SPECIAL[text] in ids, text
    think = ids.index(151667)
    assert trained[think] and not trained[ids.index(151665)]  # the assistant's think trained, the tool's not


def test_the_exported_tokenizer_agrees(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(str(tmp_path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(hf) == 151669
    decoder = hf.added_tokens_decoder
    for text, i in {**SPECIAL, **NOT_SPECIAL}.items():
        assert hf.convert_tokens_to_ids(text) == i and decoder[i].content == text
        assert decoder[i].special == (text in SPECIAL), text
    text = "x <think>\nplan</think>\n\n<tool_call>\n{\"a\": 1}\n</tool_call> done"
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert (hf.eos_token, hf.pad_token) == ("<|endoftext|>", "<|endoftext|>")


def test_the_fixture_facts_hold(tok):
    """The shared fixtures' README: eos <|im_end|> 151645, pad <|endoftext|> 151643, and the tool and think tags
    are added tokens that are not special."""
    d = fixtures_dir()
    if d is None or not (d / "README.md").is_file():
        pytest.skip("the shared fixtures are absent")
    facts = (d / "README.md").read_text()
    assert "`<|im_end|>` (151645)" in facts and "`<|endoftext|>` (151643)" in facts
    assert tok.special_token_id("<|im_end|>") == 151645 and tok.special_token_id("<|endoftext|>") == 151643
    for tag in ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert f"`{tag}`" in facts and len(tok.encode(tag)) == 1, tag
