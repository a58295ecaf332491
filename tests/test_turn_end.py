"""One rule for the end of a trained turn on every data path (docs/conversations.md, "What is trained"):

- an assistant turn is trained after its `<|im_start|>assistant\\n` header, through its <|im_end|> and the
  newline after it (TRL's mask for Qwen3): the built-in format, the recognised Qwen3 template, ChatML
  templates found by structure (prefix-preserving or not), templates cut by prefixes;
- a template with {% generation %} markers trains exactly the marked tokens;
- text documents and string completions end with the tokenizer's own eos token, trained (TRL appends it).
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.qwen3_checkpoint import fixtures_dir, write_qwen3_tokenizer
from ulysses_trainer.config import TrainConfig
from ulysses_trainer.data.chat import render_qwen3, tokenize_segments
from ulysses_trainer.data.chat_template import CHATML, MARKERS, PREFIXES
from ulysses_trainer.data.documents import build_sequences, chat_template_of
from ulysses_trainer.data.qwen_bpe import QwenBPETokenizer
from ulysses_trainer.data.tokenizer import load_tokenizer
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.parallel.sharding import IGNORE_INDEX

IM_START, IM_END, ENDOFTEXT, NEWLINE = 151644, 151645, 151643, 198

CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q1 café"},
     {"role": "assistant", "content": "a1 東京", "reasoning_content": "r1 think"},
     {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2", "reasoning_content": "r2"}],
    [{"role": "user", "content": "only one"}, {"role": "assistant", "content": "answer 🌍"}],
    [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "x1", "reasoning_content": "t1"},
     {"role": "user", "content": "u2"}, {"role": "assistant", "content": "x2"},
     {"role": "user", "content": "u3"}, {"role": "assistant", "content": "x3", "reasoning_content": "t3"}],
]

# ChatML, prefix-preserving
CHATML_PLAIN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# ChatML that drops the think blocks of turns before the last user query (as Qwen3's shipped template does)
CHATML_DROPS_THINK = (
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and "
    "loop.index0 > ns.last %}<think>\n{{ m.reasoning_content or '' }}\n</think>\n\n{% endif %}{{ m.content }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# not ChatML (no <|im_start|>): cut by prefixes; its turn end is <|endoftext|> and a newline
PLAIN_TURNS = ("{% for m in messages %}### {{ m.role }}:\n{{ m.content }}<|endoftext|>\n{% endfor %}"
               "{% if add_generation_prompt %}### assistant:\n{% endif %}")
# generation markers around the content and <|im_end|> only: the newline after it is not marked
MARKED = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
          "{{ m.content }}<|im_end|>{% endgeneration %}{{ '\n' }}{% else %}{{ m.content }}<|im_end|>\n{% endif %}"
          "{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return write_qwen3_tokenizer(tmp_path_factory.mktemp("qwen3_layout"), None)


@pytest.fixture
def checkpoint(base_dir, tmp_path):
    def make(name: str, template: str | None):
        """A Qwen3-layout tokenizer directory (eos <|im_end|>) carrying `template`."""
        d = tmp_path / name
        shutil.copytree(base_dir, d)
        if template is not None:
            cfg = json.loads((d / "tokenizer_config.json").read_text())
            cfg["chat_template"] = template
            (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        return load_tokenizer(str(d))
    return make


def _rows(tmp_path: Path, tokenizer, records: list[dict], **cfg) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, trained) of each example through build_sequences (one per row, no packing)."""
    path = tmp_path / f"data{len(list(tmp_path.glob('data*.jsonl')))}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    ds = build_sequences(TrainConfig(dataset_name=str(path), max_length=512, **cfg), tokenizer)
    out = []
    for i in range(len(ds)):
        row, n = ds[i], ds.real_tokens(i)
        out.append((row["input_ids"][:n].numpy(), (row["labels"][:n] != IGNORE_INDEX).numpy()))
    return out


def _check_chatml_turns(ids: np.ndarray, mask: np.ndarray, msgs: list[dict]) -> None:
    """Each assistant turn: header untrained, then trained through <|im_end|> and the newline after it;
    no other <|im_end|> or newline after one trained."""
    n_assistant = sum(m["role"] == "assistant" for m in msgs)
    ends = np.flatnonzero(ids == IM_END)
    assert int(mask[ends].sum()) == n_assistant
    for e in ends:
        assert ids[e + 1] == NEWLINE and mask[e + 1] == mask[e]  # the newline goes with its <|im_end|>
    headers = [s for s in np.flatnonzero(ids == IM_START) if ids[s + 2] == NEWLINE and mask[s + 3]]
    assert len(headers) == n_assistant
    for s in np.flatnonzero(ids == IM_START):
        assert not mask[s:s + 3].any()  # <|im_start|>, role, newline: never trained


def test_builtin_format_trains_through_the_newline_after_im_end(tmp_path):
    rows = _rows(tmp_path, QwenBPETokenizer(), [{"messages": m} for m in CONVERSATIONS], assistant_only_loss=True)
    for (ids, mask), msgs in zip(rows, CONVERSATIONS):
        _check_chatml_turns(ids, mask, msgs)


def test_recognised_qwen3_template_trains_through_the_newline(checkpoint, tmp_path):
    d = fixtures_dir()
    path = d / "qwen3" / "chat_template.jinja" if d else None
    if path is None or not path.is_file():
        pytest.skip("Qwen3's chat template fixture (shared/fixtures/qwen3/chat_template.jinja) is absent")
    tok = checkpoint("qwen3", path.read_text(encoding="utf-8"))
    assert chat_template_of(tok) is None  # recognised: the built-in format, training variant
    rows = _rows(tmp_path, tok, [{"messages": m} for m in CONVERSATIONS], assistant_only_loss=True)
    for (ids, mask), msgs in zip(rows, CONVERSATIONS):
        _check_chatml_turns(ids, mask, msgs)


def _expected_by_split(text: str, hf) -> np.ndarray:
    """The assistant turns' tokens found another way: the text split at <|im_start|>, a piece starting with
    "assistant\\n" trained after that header up to the next <|im_start|> (its <|im_end|>\\n)."""
    trained = np.zeros(len(text), bool)
    at = 0
    for piece in text.split("<|im_start|>"):
        if piece.startswith("assistant\n"):
            trained[at + len("assistant\n"):at + len(piece)] = True
        at += len(piece) + len("<|im_start|>")
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    return np.asarray([trained[s:e].any() for s, e in enc["offset_mapping"]])


@pytest.mark.parametrize("template", [CHATML_PLAIN, CHATML_DROPS_THINK], ids=["prefix_preserving", "drops_think"])
def test_chatml_template_trains_assistant_turns_found_by_structure(checkpoint, tmp_path, template):
    tok = checkpoint("chatml", template)
    renderer = chat_template_of(tok)
    assert renderer is not None and renderer.rule == CHATML
    hf = tok.hf_tokenizer
    calls = []
    apply = hf.apply_chat_template
    hf.apply_chat_template = lambda *a, **k: calls.append(1) or apply(*a, **k)
    try:
        rows = _rows(tmp_path, tok, [{"messages": m} for m in CONVERSATIONS], assistant_only_loss=True)
    finally:
        del hf.apply_chat_template
    assert len(calls) == len(CONVERSATIONS)  # one rendering per conversation, whatever its length
    for (ids, mask), msgs in zip(rows, CONVERSATIONS):
        text = hf.apply_chat_template(msgs, tokenize=False)
        assert ids.tolist() == hf(text, add_special_tokens=False)["input_ids"]
        expected = _expected_by_split(text, hf)
        expected[0] = False  # the first token is nobody's target
        assert mask.tolist() == expected.tolist()
        _check_chatml_turns(ids, mask, msgs)
        if template is CHATML_DROPS_THINK:  # a turn is trained as the whole conversation renders it
            last_query = max(i for i, m in enumerate(msgs) if m["role"] == "user")
            trained = hf.decode(ids[mask].tolist())
            for i, m in enumerate(msgs):
                if m.get("reasoning_content"):
                    assert (m["reasoning_content"] in trained) == (i > last_query), i
    if template is CHATML_DROPS_THINK:  # not prefix-preserving: the prefix rule would refuse it
        msgs = CONVERSATIONS[2]
        assert not hf.apply_chat_template(msgs, tokenize=False).startswith(
            hf.apply_chat_template(msgs[:2], tokenize=False))


def test_prefix_template_trains_through_its_turn_end_and_newline(checkpoint, tmp_path):
    tok = checkpoint("plain", PLAIN_TURNS)
    assert chat_template_of(tok).rule == PREFIXES
    rows = _rows(tmp_path, tok, [{"messages": m} for m in CONVERSATIONS], assistant_only_loss=True)
    for (ids, mask), msgs in zip(rows, CONVERSATIONS):
        ends = np.flatnonzero(ids == ENDOFTEXT)
        n_assistant = sum(m["role"] == "assistant" for m in msgs)
        assert int(mask[ends].sum()) == n_assistant
        assert all(ids[e + 1] == NEWLINE and mask[e + 1] == mask[e] for e in ends)
        assert tok.decode(ids[mask].tolist()) == "".join(m["content"] + "<|endoftext|>\n" for m in msgs
                                                          if m["role"] == "assistant")


def test_generation_markers_train_exactly_the_marked_tokens(checkpoint, tmp_path):
    tok = checkpoint("marked", MARKED)
    assert chat_template_of(tok).rule == MARKERS
    hf = tok.hf_tokenizer
    rows = _rows(tmp_path, tok, [{"messages": m} for m in CONVERSATIONS], assistant_only_loss=True)
    for (ids, mask), msgs in zip(rows, CONVERSATIONS):
        text = hf.apply_chat_template(msgs, tokenize=False)
        marked = np.zeros(len(text), bool)  # each assistant content and its <|im_end|>, found by search
        at = 0
        for m in msgs:
            if m["role"] == "assistant":
                head = "<|im_start|>assistant\n"
                at = text.index(head + m["content"] + "<|im_end|>", at) + len(head)
                marked[at:at + len(m["content"]) + len("<|im_end|>")] = True
        enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
        expected = np.asarray([marked[s:e].any() for s, e in enc["offset_mapping"]])
        assert ids.tolist() == enc["input_ids"]
        assert mask.tolist() == expected.tolist()
        ends = np.flatnonzero((ids == IM_END) & mask)
        assert len(ends) == sum(m["role"] == "assistant" for m in msgs)
        assert not mask[ends + 1].any()  # the newline is outside the markers: not trained


def test_trl_training_template_as_markers_equals_builtin_format(checkpoint, tmp_path):
    """TRL's own Qwen3 training template given as the checkpoint's template (generation markers): the same ids and
    trained tokens as the built-in format, which renders that variant itself."""
    trl = pytest.importorskip("trl")
    template = (Path(trl.__file__).parent / "chat_templates" / "qwen3_training.jinja").read_text()
    tok = checkpoint("trl_training", template)
    assert chat_template_of(tok).rule == MARKERS
    records = [{"messages": m} for m in CONVERSATIONS]
    marked = _rows(tmp_path, tok, records, assistant_only_loss=True)
    for (ids, mask), msgs in zip(marked, CONVERSATIONS):
        b_ids, b_mask = tokenize_segments(render_qwen3(msgs, None, True), tok)  # the recognised template's path
        b_mask[0] = False  # the first token is nobody's target
        assert ids.tolist() == b_ids.tolist() and mask.tolist() == b_mask.tolist()
        _check_chatml_turns(ids, mask, msgs)


def test_refusal_names_the_markers_not_removing_the_template(checkpoint, tmp_path):
    rewrites = "{% for m in messages %}{{ m.content if loop.last else '' }}<|endoftext|>{% endfor %}"
    tok = checkpoint("rewrites", rewrites)
    with pytest.raises(ConfigError) as err:
        chat_template_of(tok).conversation(CONVERSATIONS[0], None, True, "x")
    msg = str(err.value)
    assert "{% generation %}" in msg and "assistant_only_loss false" in msg
    assert not any(w in msg.lower() for w in ("delete", "remove", "without a template", "give the tokenizer"))


@pytest.mark.parametrize("own", [False, True], ids=["qwen_bpe", "qwen3_checkpoint"])
def test_text_and_string_completions_end_with_the_tokenizers_eos(checkpoint, tmp_path, own):
    tok = checkpoint("eos", None) if own else QwenBPETokenizer()
    eos = IM_END if own else ENDOFTEXT  # the tokenizer's own eos_token, as TRL appends it
    assert tok.eos_token_id == eos
    pairs = [{"prompt": "Q: two?", "completion": " A: 2"}, {"prompt": "Say hi", "completion": " hi"}]
    for (ids, mask), pair in zip(_rows(tmp_path, tok, pairs), pairs):
        assert ids.tolist() == tok.encode(pair["prompt"]) + tok.encode(pair["completion"]) + [eos]
        assert tok.decode(ids[mask].tolist()) == pair["completion"] + tok.eos_token  # completion and eos trained
    docs = ["first document", "second one, café"]
    want = [tok.encode(d) + [eos] for d in docs]
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    joined = build_sequences(TrainConfig(dataset_name=str(path), max_length=4), tok)  # joined end to end, cut
    stream = want[0] + want[1]
    assert joined.tokens.tolist() == stream[:len(stream) // 4 * 4] and joined.trained is None  # every token trained
    [(ids, mask)] = _rows(tmp_path, tok, [{"text": d} for d in docs], packing=True)  # whole documents (bfd)
    assert ids.tolist() in (want[0] + want[1], want[1] + want[0])
    assert mask[ids == eos].all() and int(mask.sum()) == len(ids) - 2  # all but each document's first token


@pytest.mark.parametrize("template", [None, CHATML_PLAIN], ids=["builtin", "chatml_template"])
def test_conversational_completion_trains_through_its_final_newline(checkpoint, tmp_path, template):
    tok = checkpoint("pc", template) if template else QwenBPETokenizer()
    rec = {"prompt": [{"role": "user", "content": "Q?"}], "completion": [{"role": "assistant", "content": "A!"}]}
    [(ids, mask)] = _rows(tmp_path, tok, [rec])
    assert ids[-2:].tolist() == [IM_END, NEWLINE] and mask[-2:].all()
    start = np.flatnonzero(ids == IM_START)[-1]
    assert not mask[start:start + 3].any() and mask[start + 3:].all()
