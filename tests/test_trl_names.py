"""TRL's spellings of our settings: decoded once, into the fields they stand for; contradictions refused."""

import pytest

from ulysses_trainer.cli.argv import parse_overrides
from ulysses_trainer.config import TrainConfig, config_to_dict
from ulysses_trainer.config.load import build_config, config_from_dict
from ulysses_trainer.errors import ConfigError


def _cfg(*argv):
    _, over = parse_overrides(list(argv))
    return build_config(None, over)


def test_max_steps_minus_one_means_epochs_decide():
    assert TrainConfig().max_steps is None and _cfg("--max_steps", "-1").max_steps is None
    assert _cfg("--max_steps", "7").max_steps == 7
    assert _cfg("--max_steps", "-1", "--num_train_epochs", "2").num_train_epochs == 2.0


def test_gradient_checkpointing_kwargs_offload():
    assert _cfg("--gradient_checkpointing_kwargs", "{offload: true}").activation_offload is True
    assert _cfg("--gradient_checkpointing_kwargs", "{offload: false, use_reentrant: false}").activation_offload is False
    assert _cfg("--gradient_checkpointing_kwargs", "{offload: true}", "--activation_offload", "true") \
        .activation_offload is True
    with pytest.raises(ConfigError, match="asks for activation_offload true but activation_offload is 3"):
        _cfg("--gradient_checkpointing_kwargs", "{offload: true}", "--activation_offload", "3")
    with pytest.raises(ConfigError, match="unknown keys \\['foo'\\]"):
        _cfg("--gradient_checkpointing_kwargs", "{foo: 1}")


def test_dtype_and_eval_strategy():
    assert _cfg("--dtype", "bfloat16").bf16 is True and _cfg("--dtype", "float32").bf16 is False
    assert _cfg("--dtype", "auto").bf16 == "auto"
    with pytest.raises(ConfigError, match="set only one of them"):
        _cfg("--dtype", "float32", "--bf16", "true")
    with pytest.raises(ConfigError, match="float16 is not supported"):
        _cfg("--dtype", "float16")
    assert _cfg("--eval_strategy", "steps", "--logging_steps", "5").eval_steps == 5
    assert _cfg("--eval_strategy", "steps", "--eval_steps", "3").eval_steps == 3
    assert _cfg("--eval_strategy", "no", "--eval_steps", "3").eval_steps is None


def test_saved_config_round_trips_with_trl_spellings():
    cfg = _cfg("--gradient_checkpointing_kwargs", "{offload: true}", "--dtype", "bfloat16", "--eval_strategy", "steps")
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_unknown_trl_names_point_at_the_setting():
    for name, ours in (("max_seq_length", "max_length"), ("evaluation_strategy", "eval_strategy"),
                       ("torch_dtype", "dtype")):
        with pytest.raises(ConfigError, match=f"setting for that is {ours}"):
            _cfg(f"--{name}", "1")


def test_trl_options_that_do_not_apply_get_their_reason_not_a_look_alike():
    for name, reason in (("push_to_hub", "does not upload"), ("fsdp", "DeepSpeed ZeRO-3 only"),
                         ("dataset_config", "config name is not supported"), ("hub_model_id", "does not upload"),
                         ("load_best_model_at_end", "last step's model")):
        with pytest.raises(ConfigError, match=f"^{name} \\(command line\\) is a TRL option this trainer does not "
                                              f"support: .*{reason}.*; remove it$"):
            _cfg(f"--{name}", "1")
    with pytest.raises(ConfigError, match="setting for that is peft_config \\{use_rslora: true\\}"):
        _cfg("--use_rslora", "true")


def test_did_you_mean_only_for_a_close_name():
    from ulysses_trainer.config import FIELDS
    from ulysses_trainer.config.name_hints import suggest

    assert suggest("learning_rat", list(FIELDS)) == "; did you mean 'learning_rate'?"
    assert suggest("logging_firststep", list(FIELDS)) == "; did you mean 'logging_first_step'?"
    for far in ("dataset_configuration", "use_rslora_x", "packing_mode"):  # share a suffix, not a typo
        assert suggest(far, list(FIELDS)) == "; run with --help for the list of fields", far


def test_every_sft_config_field_is_a_field_a_spelling_or_refused():
    import dataclasses

    trl = pytest.importorskip("trl")
    from ulysses_trainer.config import FIELDS
    from ulysses_trainer.config.load import IGNORED
    from ulysses_trainer.config.name_hints import REFUSED, TRL_NAMES

    names = {f.name for f in dataclasses.fields(trl.SFTConfig) if not f.name.startswith("_")}
    assert not names - set(FIELDS) - set(TRL_NAMES) - set(REFUSED) - IGNORED
    assert not (set(REFUSED) | set(TRL_NAMES)) & set(FIELDS)  # a field added later: strike its entry
