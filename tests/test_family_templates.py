"""The chat templates the families beyond Qwen ship, with assistant_only_loss (docs/conversations.md, "What is
trained"): a shipped template TRL knows is rendered with TRL's training variant of it, whose {% generation %} blocks
mark what is trained (as TRL's SFTTrainer does); a template with markers of its own trains exactly those; one that
renders earlier turns the same whatever follows is cut by prefixes; any other is refused, exit 2, in one line naming
the fix. The tokenizers are word-level ones whose special tokens are the family's chat tokens (built offline).

Each test states the trained tokens a user expects: every assistant message's words and its turn-end token, and
nothing of a header, a user or a system message.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.family_checkpoints import EOS, write_family_checkpoint, write_tokenizer
from ulysses_trainer.config import TrainConfig
from ulysses_trainer.data.chat_template import MARKERS, PREFIXES, TemplateRenderer
from ulysses_trainer.data.documents import build_sequences, chat_template_of
from ulysses_trainer.data.tokenizer import load_tokenizer
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.parallel.sharding import IGNORE_INDEX

LLAMA_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
GEMMA_SPECIALS = ("<bos>", "<start_of_turn>", "<end_of_turn>")
MISTRAL_SPECIALS = ("<s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
PHI3_SPECIALS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
QWEN_SPECIALS = ("<|im_start|>", "<|im_end|>")
GPT_OSS_SPECIALS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")

CONVERSATIONS = [
    [{"role": "system", "content": "kilo lima"}, {"role": "user", "content": "alpha bravo"},
     {"role": "assistant", "content": "charlie delta echo"}, {"role": "user", "content": "foxtrot"},
     {"role": "assistant", "content": "golf hotel"}],
    [{"role": "user", "content": "india"}, {"role": "assistant", "content": "juliet mike"}],
]
NO_SYSTEM = [[m for m in c if m["role"] != "system"] for c in CONVERSATIONS]

# Llama 3.1's shape: a system header always written (its date lines), bos first, `| trim` content, <|eot_id|> ends
LLAMA31_LIKE = (
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = 'november' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}{{- 'oscar papa\n\n' }}{{- system_message }}"
    "{{- '<|eot_id|>' }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")
# Gemma's shape: bos, the system text prefixed to the first user turn, the assistant's role written `model`
GEMMA_LIKE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + "
    "'\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
# Mistral 7B v0.3's shape: the system message goes into the LAST user turn, so an earlier turn renders otherwise
# once more turns follow (neither markers nor TRL's variant: refused for assistant_only_loss)
MISTRAL_V03_LIKE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}{{- '[INST] ' + system_message + '\n\n' + message['content'] + "
    "'[/INST]' }}{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}{%- endif %}{%- endfor %}")
# Mistral-Small's shape ([SYSTEM_PROMPT] first), with {% generation %} markers written into it by its user
MISTRAL_SMALL_MARKED = (
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + messages[0]['content'] + "
    "'[/SYSTEM_PROMPT]' }}{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}"
    "{%- endif %}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}{{- '[INST]' + "
    "message['content'] + '[/INST]' }}{%- elif message['role'] == 'assistant' %}{%- generation %}"
    "{{- message['content'] + eos_token }}{%- endgeneration %}{%- endif %}{%- endfor %}")


def _tokenizer(tmp_path: Path, specials: tuple[str, ...], template: str, bos: str | None = None):
    d = tmp_path / f"tok{len(list(tmp_path.glob('tok*')))}"
    write_tokenizer(d, specials, template, bos=bos)
    return load_tokenizer(str(d))


def _rows(tmp_path: Path, tokenizer, conversations: list[list[dict]]) -> list[tuple[list[int], list[int]]]:
    """(ids, trained ids) of each conversation through build_sequences, assistant_only_loss (one per row)."""
    path = tmp_path / f"data{len(list(tmp_path.glob('data*.jsonl')))}.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    ds = build_sequences(TrainConfig(dataset_name=str(path), max_length=256, assistant_only_loss=True), tokenizer)
    out = []
    for i in range(len(ds)):
        row, n = ds[i], ds.real_tokens(i)
        ids, trained = row["input_ids"][:n].numpy(), (row["labels"][:n] != IGNORE_INDEX).numpy()
        out.append((ids.tolist(), ids[trained].tolist()))
    return out


def _expected(tok, msgs: list[dict], end: str, prefix: str = "", last_end: str | None = None,
              after_last: tuple[str, ...] = ()) -> list[int]:
    """Every assistant message's `prefix` tokens, its words and its turn end (`last_end` for the last one, then
    `after_last`)."""
    hf, want = tok.hf_tokenizer, []
    turns = [m for m in msgs if m["role"] == "assistant"]
    for i, m in enumerate(turns):
        last = i == len(turns) - 1
        want += tok.encode(prefix) + tok.encode(m["content"]) + [hf.convert_tokens_to_ids(
            last_end if last and last_end is not None else end)]
    return want + hf.convert_tokens_to_ids(list(after_last))


def _trl_template(name: str) -> str:
    trl = pytest.importorskip("trl", reason="the dev extra installs trl, whose shipped templates these are")
    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text(encoding="utf-8")


def test_llama31_shaped_template_trains_each_answer_and_its_eot_by_prefixes(tmp_path):
    tok = _tokenizer(tmp_path, LLAMA_SPECIALS, LLAMA31_LIKE, bos="<|begin_of_text|>")
    assert chat_template_of(tok).rule == PREFIXES and chat_template_of(tok).training is None
    for (ids, trained), msgs in zip(_rows(tmp_path, tok, CONVERSATIONS), CONVERSATIONS):
        assert trained == _expected(tok, msgs, "<|eot_id|>"), msgs
        assert ids[0] == tok.special_token_id("<|begin_of_text|>")


@pytest.mark.parametrize("name, specials, bos, end, prefix, last_end, after_last", [
    ("llama3", LLAMA_SPECIALS, "<|begin_of_text|>", "<|eot_id|>", "", None, ()),
    ("gemma3", GEMMA_SPECIALS, "<bos>", "<end_of_turn>", "", None, ()),
    ("phi3", PHI3_SPECIALS, None, "<|end|>", "", None, (EOS,)),
    ("phi3_5", PHI3_SPECIALS, None, "<|end|>", "", None, (EOS,)),
    ("qwen2_5", QWEN_SPECIALS, None, "<|im_end|>", "", None, ()),
    ("gptoss", GPT_OSS_SPECIALS, None, "<|end|>", "<|start|>assistant<|channel|>final<|message|>", "<|return|>", ()),
], ids=["llama3", "gemma3", "phi3", "phi3.5", "qwen2.5", "gpt-oss"])
def test_a_shipped_template_trl_knows_trains_as_its_training_variant_marks(tmp_path, name, specials, bos, end, prefix,
                                                                           last_end, after_last):
    """The template Llama 3, Gemma 3, Phi-3, Phi-3.5, Qwen2.5 or gpt-oss checkpoints ship (TRL's copy): rendered with
    TRL's training variant, its {% generation %} blocks trained: each answer's words and its turn end (Phi-3's last
    answer also its eos, gpt-oss's its <|return|>, each gpt-oss answer with its channel header), nothing else."""
    tok = _tokenizer(tmp_path, specials, _trl_template(name), bos=bos)
    renderer = chat_template_of(tok)
    assert renderer.training == _trl_template(f"{name}_training")  # TRL's own variant, byte for byte
    convs = CONVERSATIONS if name != "gptoss" else NO_SYSTEM  # gpt-oss writes its own system message
    for (_, trained), msgs in zip(_rows(tmp_path, tok, convs), convs):
        assert trained == _expected(tok, msgs, end, prefix, last_end, after_last), msgs


def test_phi3s_shipped_template_is_refused_without_its_training_variant(tmp_path):
    """Phi-3's template ends a conversation with eos and no turn before it: an earlier answer renders otherwise once
    more turns follow, so prefixes cannot cut it; its TRL variant is what trains it (above)."""
    tok = _tokenizer(tmp_path, PHI3_SPECIALS, _trl_template("phi3"))
    with pytest.raises(ConfigError, match="renders earlier turns differently"):
        TemplateRenderer(tok.hf_tokenizer, tok.name).conversation(NO_SYSTEM[0], None, True, "x")


def test_gemma_shaped_template_trains_each_answer_and_its_end_of_turn(tmp_path):
    """Gemma's shape written by hand (not TRL's text): cut by prefixes, the same trained tokens as TRL's variant."""
    tok = _tokenizer(tmp_path, GEMMA_SPECIALS, GEMMA_LIKE, bos="<bos>")
    assert chat_template_of(tok).rule == PREFIXES
    for (ids, trained), msgs in zip(_rows(tmp_path, tok, CONVERSATIONS), CONVERSATIONS):
        assert trained == _expected(tok, msgs, "<end_of_turn>"), msgs
        assert (tok.encode("kilo")[0] in ids) == (msgs[0]["role"] == "system")  # in the first user turn, untrained


def test_mistral_shaped_template_with_its_own_markers_trains_exactly_them(tmp_path):
    tok = _tokenizer(tmp_path, MISTRAL_SPECIALS, MISTRAL_SMALL_MARKED, bos="<s>")
    assert chat_template_of(tok).rule == MARKERS
    for (_, trained), msgs in zip(_rows(tmp_path, tok, CONVERSATIONS), CONVERSATIONS):
        assert trained == _expected(tok, msgs, EOS), msgs


def test_mistral_v03_shaped_template_trains_without_a_system_message_and_is_refused_with_one(tmp_path, capsys):
    """Without a system message v0.3's template is prefix-preserving: each answer and its eos trained. With one, the
    system text moves to the last user turn as turns are added: `ulysses-trainer data` exits 2 with one line naming
    the fixes (assistant_only_loss false, or a template with {% generation %} through chat_template_path)."""
    from ulysses_trainer.cli.data import main

    d = tmp_path / "mistral"
    vocab = write_tokenizer(d, MISTRAL_SPECIALS, MISTRAL_V03_LIKE, bos="<s>")
    write_family_checkpoint(d, "mistral", vocab_size=vocab)
    tok = load_tokenizer(str(d))
    for (_, trained), msgs in zip(_rows(tmp_path, tok, NO_SYSTEM), NO_SYSTEM):
        assert trained == _expected(tok, msgs, EOS), msgs
    path = tmp_path / "system.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    capsys.readouterr()
    assert main(["--model_name_or_path", str(d), "--dataset_name", str(path), "--max_length", "64",
                 "--assistant_only_loss", "true"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # datasets' bar aside
    assert len(errors) == 1 and errors[0].startswith("error: "), errors
    err = errors[0]
    assert "{% generation %}" in err and "assistant_only_loss false" in err and "chat_template_path" in err


def test_every_training_variant_shipped_is_trls_own():
    """The variants in chat_templates/ are TRL's files byte for byte, each under the hash of the template it
    stands for."""
    import hashlib
    from importlib import resources

    from ulysses_trainer.data.training_templates import TRAINING_VARIANTS, training_variant

    for digest, file in TRAINING_VARIANTS.items():
        original = _trl_template(file.removesuffix("_training.jinja"))
        assert hashlib.sha256(original.encode("utf-8")).hexdigest() == digest
        assert training_variant(original) == _trl_template(file.removesuffix(".jinja"))
        assert resources.files("ulysses_trainer.data").joinpath("chat_templates", file).read_bytes() == \
            (Path(pytest.importorskip("trl").__file__).parent / "chat_templates" / file).read_bytes()
    assert training_variant(LLAMA31_LIKE) is None and training_variant({"default": _trl_template("gemma3")})
