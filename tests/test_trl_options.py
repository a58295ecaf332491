"""TRL options: decoded once in the config, or read where they act; those with no effect refused."""

import json

import pytest

from ulysses_trainer.config.load import build_config
from ulysses_trainer.errors import ConfigError


def test_warmup_ratio_gives_ceil_of_total_and_warmup_steps_wins():
    assert build_config({"warmup_ratio": 0.25}).warmup_for(10) == 3
    assert build_config({"warmup_ratio": 0.25, "warmup_steps": 1}).warmup_for(10) == 1
    with pytest.raises(ConfigError, match="warmup_ratio"):
        build_config({"warmup_ratio": 1.5})


def test_padding_free_sets_packing():
    assert build_config({"padding_free": True}).packing is True


def test_use_liger_kernel_is_the_triton_norm_and_needs_lean_norm():
    assert build_config({"use_liger_kernel": True}).norm_kernel == "triton"
    with pytest.raises(ConfigError, match="lean_norm"):
        build_config({"use_liger_kernel": True, "lean_norm": False})
    with pytest.raises(ConfigError, match="set only one"):
        build_config({"use_liger_kernel": True, "norm_kernel": "torch"})


def test_save_safetensors_false_is_refused_with_reason():
    with pytest.raises(ConfigError, match="always written as safetensors"):
        build_config({"save_safetensors": False})


# ---------------------------------------------------------------- strategies, logging_first_step
def test_epoch_ends_by_the_whole_dataset_sampler():
    from ulysses_trainer.train.strategies import ends_epoch

    # 10 rows, 4 a step: rows 8-11 finish the first pass, rows 16-19 the second
    assert [s for s in range(1, 8) if ends_epoch(s, 4, 10)] == [3, 5]
    assert [s for s in range(1, 5) if ends_epoch(s, 5, 10)] == [2, 4]


def test_log_eval_save_due_by_strategy():
    from ulysses_trainer.train.strategies import eval_due, log_due, save_due

    steps = build_config({"logging_steps": 3})
    assert [s for s in range(1, 8) if log_due(steps, s, 7, False)] == [3, 6, 7]  # and the last step
    first = build_config({"logging_steps": 3, "logging_first_step": True})
    assert [s for s in range(1, 8) if log_due(first, s, 7, False)] == [1, 3, 6, 7]
    epoch = build_config({"logging_strategy": "epoch"})
    assert log_due(epoch, 2, 7, True) and not log_due(epoch, 3, 7, False) and log_due(epoch, 7, 7, False)
    never = build_config({"logging_strategy": "no"})
    assert not any(log_due(never, s, 7, s == 7) for s in range(1, 8))
    assert eval_due(build_config({"eval_strategy": "epoch"}), 4, True)
    assert not eval_due(build_config({"eval_strategy": "epoch"}), 4, False)
    assert eval_due(build_config({"eval_steps": 2}), 4, False) and not eval_due(build_config({}), 4, True)
    assert save_due(build_config({"save_strategy": "epoch"}), 3, True)
    assert not save_due(build_config({"save_strategy": "epoch"}), 4, False)
    assert save_due(build_config({"save_steps": 2}), 4, False) and not save_due(build_config({}), 4, True)
    assert not save_due(build_config({"save_strategy": "no"}), 4, True)


def test_strategy_settings_without_effect_are_refused():
    with pytest.raises(ConfigError, match="save_steps 2 has no effect with save_strategy epoch"):
        build_config({"save_strategy": "epoch", "save_steps": 2})
    with pytest.raises(ConfigError, match="logging_steps 5 has no effect with logging_strategy epoch"):
        build_config({"logging_strategy": "epoch", "logging_steps": 5})
    with pytest.raises(ConfigError, match="logging_first_step true has no effect with logging_strategy no"):
        build_config({"logging_strategy": "no", "logging_first_step": True})
    with pytest.raises(ConfigError, match="eval_strategy epoch evaluates at each epoch end, but eval_steps is 3"):
        build_config({"eval_strategy": "epoch", "eval_steps": 3})
    with pytest.raises(ConfigError, match="save_only_model true has no effect with save_strategy no"):
        build_config({"save_only_model": True, "save_strategy": "no"})
    assert build_config({"eval_strategy": "epoch"}).evaluates and not build_config({}).evaluates


def test_eval_strategy_epoch_needs_eval_data(tmp_path):
    from ulysses_trainer.config import validate_config

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n')
    with pytest.raises(ConfigError, match="evaluation is on .* set eval_dataset_name"):
        validate_config(build_config({"eval_strategy": "epoch", "dataset_name": str(data)}), 1)


# ---------------------------------------------------------------- run_name, save_only_model
def test_run_name_names_the_tensorboard_directory_and_is_checked(capsys):
    from ulysses_trainer.train.run_log import tensorboard_dir
    from ulysses_trainer.train.run_report import report_run_name

    assert tensorboard_dir("out", "try-2") == "out/runs/try-2" and tensorboard_dir("out") == "out/runs"
    report_run_name("try-2")
    assert capsys.readouterr().out == "[ulysses_trainer] run try-2\n"
    with pytest.raises(ConfigError, match="run_name 'a/b' must be a non-empty name without '/'"):
        build_config({"run_name": "a/b"})


def test_overwrite_clears_a_named_runs_events(tmp_path):
    from ulysses_trainer.train.checkpoint import clear_previous_run

    (tmp_path / "runs" / "try-2").mkdir(parents=True)
    (tmp_path / "runs" / "try-2" / "events.out.tfevents.1.host").write_text("x")
    (tmp_path / "runs" / "notes.txt").write_text("mine")
    clear_previous_run(str(tmp_path))
    assert not (tmp_path / "runs" / "try-2").exists() and (tmp_path / "runs" / "notes.txt").exists()


def test_weights_only_checkpoint_is_marked_and_its_resume_refused(tmp_path):
    from ulysses_trainer.train.checkpoint import MARKER, WEIGHTS_ONLY, find_checkpoint, mark_weights_only

    (tmp_path / "checkpoint-4").mkdir()
    mark_weights_only(str(tmp_path), 4, is_main=True)
    assert (tmp_path / "checkpoint-4" / WEIGHTS_ONLY).is_file() and (tmp_path / "checkpoint-4" / MARKER).is_file()
    assert (tmp_path / "latest").read_text().strip() == "checkpoint-4"
    for how in (True, str(tmp_path / "checkpoint-4")):
        with pytest.raises(ConfigError, match="written with save_only_model true.*no optimizer or scheduler state"):
            find_checkpoint(how, str(tmp_path))


# ---------------------------------------------------------------- tokenizer options
def _own_tokenizer(path):
    from tests.tiny_checkpoint import _write_tokenizer
    from ulysses_trainer.data.tokenizer import load_tokenizer

    _write_tokenizer(path)
    return load_tokenizer(str(path))


TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }} {{ eos_token }} {% endfor %}"


def test_chat_template_path_file_or_tokenizer_dir_replaces_the_template(tmp_path):
    from ulysses_trainer.data.chat import render_text
    from ulysses_trainer.data.documents import chat_template_of
    from ulysses_trainer.data.tokenizer import apply_tokenizer_options

    (tmp_path / "t.jinja").write_text(TEMPLATE)
    tok = apply_tokenizer_options(_own_tokenizer(tmp_path / "tok"), str(tmp_path / "t.jinja"), None)
    msgs = [{"role": "user", "content": "alpha"}, {"role": "assistant", "content": "bravo"}]
    assert render_text(chat_template_of(tok).conversation(msgs, None, False, "x")) == \
        "[user] alpha <|endoftext|> [assistant] bravo <|endoftext|> "
    donor = tmp_path / "donor"
    donor.mkdir()
    (donor / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE.replace("[", "<")}))
    tok2 = apply_tokenizer_options(_own_tokenizer(tmp_path / "tok2"), str(donor), None)
    assert tok2.hf_tokenizer.chat_template.startswith("{% for m in messages %}<{{ m.role }}")
    # the same checks as a checkpoint's own: a template that rewrites earlier turns is refused for masks
    (tmp_path / "last.jinja").write_text("{% for m in messages %}{{ m.content if loop.last else '' }}{% endfor %}")
    tok3 = apply_tokenizer_options(_own_tokenizer(tmp_path / "tok3"), str(tmp_path / "last.jinja"), None)
    with pytest.raises(ConfigError, match="renders earlier turns differently"):
        chat_template_of(tok3).conversation(msgs + [{"role": "user", "content": "q"}], None, True, "x")


def test_chat_template_path_refusals(tmp_path):
    from ulysses_trainer.data.qwen_bpe import QwenBPETokenizer
    from ulysses_trainer.data.tokenizer import apply_tokenizer_options

    tok = _own_tokenizer(tmp_path / "tok")
    with pytest.raises(ConfigError, match="chat_template_path .*nope.jinja not found"):
        apply_tokenizer_options(tok, str(tmp_path / "nope.jinja"), None)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ConfigError, match="a directory without a chat template"):
        apply_tokenizer_options(tok, str(tmp_path / "empty_dir"), None)
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="not a valid Jinja template"):
        apply_tokenizer_options(tok, str(tmp_path / "bad.jinja"), None)
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    with pytest.raises(ConfigError, match="needs the checkpoint's own tokenizer"):
        apply_tokenizer_options(QwenBPETokenizer(), str(tmp_path / "t.jinja"), None)


def test_eos_token_ends_text_documents_and_must_be_known(tmp_path):
    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.data.documents import build_sequences
    from ulysses_trainer.data.qwen_bpe import QwenBPETokenizer
    from ulysses_trainer.data.tokenizer import apply_tokenizer_options

    tok = apply_tokenizer_options(QwenBPETokenizer(), None, "<|im_end|>")
    assert tok.eos_token_id == 151645 and tok.eos_token == "<|im_end|>"
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(40)))
    ds = build_sequences(TrainConfig(dataset_name=str(data), max_length=16, eos_token="<|im_end|>"), tok)
    assert 151645 in ds.tokens and 151643 not in ds.tokens
    with pytest.raises(ConfigError, match="eos_token '<nope>' is not a token of the Qwen BPE"):
        apply_tokenizer_options(QwenBPETokenizer(), None, "<nope>")
    with pytest.raises(ConfigError, match="eos_token 'omega' is not a token of the tokenizer"):
        apply_tokenizer_options(_own_tokenizer(tmp_path / "tok"), None, "omega")
    own = apply_tokenizer_options(_own_tokenizer(tmp_path / "tok2"), None, "alpha")
    assert own.eos_token_id == 2 and own.hf_tokenizer.eos_token == "alpha"


# ---------------------------------------------------------------- settings with no effect on the data
def _messages_file(path, arguments='{"q": 1}'):
    row = {"messages": [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "", "tool_calls": [
                            {"function": {"name": "look", "arguments": arguments}}]}]}
    path.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    return path


@pytest.mark.parametrize("setting, pattern", [
    ({"completion_only_loss": True}, "completion_only_loss has no effect here: .* is conversational"),
    ({"dataset_text_field": "body"}, "dataset_text_field 'body' has no effect here"),
    ({"eos_token": "<|endoftext|>"}, "eos_token '<\\|endoftext\\|>' has no effect here: .*<\\|im_end\\|>"),
])
def test_settings_without_effect_on_conversations_are_refused(tmp_path, setting, pattern):
    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.data.documents import build_sequences
    from ulysses_trainer.data.qwen_bpe import QwenBPETokenizer

    data = _messages_file(tmp_path / "chat.jsonl")
    with pytest.raises(ConfigError, match=pattern):
        build_sequences(TrainConfig(dataset_name=str(data), max_length=64, **setting), QwenBPETokenizer())


def test_completion_only_loss_on_text_is_refused_by_the_data_command(tmp_path, capsys):
    from ulysses_trainer.cli.data import main

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "alpha bravo"}\n')
    assert main(["--dataset_name", str(data), "--completion_only_loss", "true", "--max_length", "8"]) == 2
    assert "completion_only_loss has no effect here" in capsys.readouterr().err


def test_non_json_tool_call_arguments_are_refused_with_the_example(tmp_path):
    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.data.documents import build_sequences
    from ulysses_trainer.data.qwen_bpe import QwenBPETokenizer

    good = build_sequences(TrainConfig(dataset_name=str(_messages_file(tmp_path / "a.jsonl")), max_length=64),
                           QwenBPETokenizer())
    assert len(good) == 2
    bad = _messages_file(tmp_path / "b.jsonl", arguments="q=1")
    with pytest.raises(ConfigError, match=r"example 0, message 1: tool call 'look' has arguments 'q=1', a string "
                                          r"that is not JSON"):
        build_sequences(TrainConfig(dataset_name=str(bad), max_length=64), QwenBPETokenizer())


def test_lora_settings_without_use_peft_are_refused():
    with pytest.raises(ConfigError, match="lora_r has no effect without use_peft true"):
        build_config({"lora_r": 8})
    with pytest.raises(ConfigError, match="lora_alpha, merge_lora have no effect without use_peft"):
        build_config({"lora_alpha": 8, "merge_lora": True})
    assert build_config({"lora_r": 8, "use_peft": True}).lora_r == 8


def test_dataset_num_proc_must_be_positive():
    assert build_config({"dataset_num_proc": 4}).dataset_num_proc == 4
    with pytest.raises(ConfigError, match="dataset_num_proc must be >= 1"):
        build_config({"dataset_num_proc": 0})


def test_eos_token_ends_string_completions_and_is_refused_on_message_pairs(tmp_path):
    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.data.documents import build_sequences
    from ulysses_trainer.data.qwen_bpe import QwenBPETokenizer
    from ulysses_trainer.data.tokenizer import apply_tokenizer_options

    strings = tmp_path / "pc.jsonl"
    strings.write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
    tok = apply_tokenizer_options(QwenBPETokenizer(), None, "<|im_end|>")
    ds = build_sequences(TrainConfig(dataset_name=str(strings), max_length=16, eos_token="<|im_end|>"), tok)
    row = ds[0]
    assert int(row["input_ids"][row["real_tokens"] - 1]) == 151645  # the completion ends with eos_token
    lists = tmp_path / "pc_messages.jsonl"
    lists.write_text(json.dumps({"prompt": [{"role": "user", "content": "2+2="}],
                                 "completion": [{"role": "assistant", "content": "4"}]}) + "\n")
    with pytest.raises(ConfigError, match="eos_token '<\\|endoftext\\|>' has no effect here: .*of messages"):
        build_sequences(TrainConfig(dataset_name=str(lists), max_length=64, eos_token="<|endoftext|>"),
                        QwenBPETokenizer())
