"""TrainConfig: defaults < recipe < command line, types, unknown names, cross-field validation."""

import json
from pathlib import Path

import pytest

from ulysses_trainer.cli.argv import load_config
from ulysses_trainer.cli.train import format_help
from ulysses_trainer.config import TrainConfig, config_to_dict, validate_config
from ulysses_trainer.config.load import config_from_dict
from ulysses_trainer.errors import ConfigError


def _recipe(tmp_path: Path, text: str) -> str:
    p = tmp_path / "recipe.yaml"
    p.write_text(text)
    return str(p)


def test_defaults_are_the_embedded_cpu_run():
    cfg = load_config([])
    assert cfg == TrainConfig()
    assert cfg.model_name_or_path == "tiny" and cfg.dataset_name is None and cfg.sp_size is None
    assert cfg.bf16 == "auto" and cfg.activation_offload == "auto" and cfg.loss_type == "chunked_nll"
    assert Path(cfg.deepspeed).is_file() and Path(cfg.deepspeed).name == "zero3.json"
    validate_config(cfg, world_size=2)


def test_cli_overrides_recipe_overrides_defaults(tmp_path):
    r = _recipe(tmp_path, "max_length: 8192\nlearning_rate: 3.0e-5\nmax_steps: 10\n")
    cfg = load_config(["--config", r, "--max_steps", "7", "--output_dir=out/x"])
    assert cfg.max_length == 8192  # recipe over default
    assert cfg.learning_rate == pytest.approx(3e-5)
    assert cfg.max_steps == 7  # command line over recipe
    assert cfg.output_dir == "out/x"
    assert cfg.seed == TrainConfig().seed  # untouched default
    cfg2 = load_config([f"--config={r}"])
    assert cfg2.max_steps == 10


def test_values_are_parsed_as_yaml():
    cfg = load_config(["--bf16", "false", "--model_init_kwargs",
                       '{"rope_parameters": {"rope_type": "yarn", "factor": 4}}',
                       "--activation_offload", "3", "--tiled_mlp", "true", "--sp_size", "null",
                       "--learning_rate", "1e-4", "--host_memory_gb", "64"])
    assert cfg.bf16 is False
    assert cfg.model_init_kwargs == {"rope_parameters": {"rope_type": "yarn", "factor": 4}}
    assert cfg.activation_offload == 3 and not isinstance(cfg.activation_offload, bool)
    assert cfg.tiled_mlp is True
    assert cfg.sp_size is None
    assert cfg.learning_rate == 1e-4  # YAML reads 1e-4 as a string; the float field converts it
    assert cfg.host_memory_gb == 64.0 and isinstance(cfg.host_memory_gb, float)


def test_local_rank_is_accepted_and_ignored():
    assert load_config(["--local_rank", "3"]) == TrainConfig()
    assert load_config(["--local_rank=1", "--max_steps", "2"]).max_steps == 2


def test_bare_flag_means_true_only_for_booleans():
    assert load_config(["--packing"]).packing is True
    assert load_config(["--packing", "--max_steps", "2"]).packing is True
    with pytest.raises(ConfigError, match="--max_length needs a value"):
        load_config(["--max_length"])


def test_unknown_names_suggest_the_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config name 'max_lenght' \(command line\).*'max_length'"):
        load_config(["--max_lenght", "10"])
    r = _recipe(tmp_path, "learning_rat: 0.1\n")
    with pytest.raises(ConfigError, match=r"'learning_rat' \(in recipe .*recipe.yaml\).*'learning_rate'"):
        load_config(["--config", r])
    with pytest.raises(ConfigError, match="unexpected argument 'oops'"):
        load_config(["oops"])


@pytest.mark.parametrize("argv, pattern", [
    (["--max_steps", "abc"], r"max_steps must be an integer or null, got 'abc'"),
    (["--max_steps", "true"], r"max_steps must be an integer or null, got True"),
    (["--max_length", "1.5"], r"max_length must be an integer, got 1.5"),
    (["--attn_implementation", "flash"], r"attn_implementation must be 'auto' \| 'sdpa'.*did you mean"),
    (["--loss_type", "ce"], r"loss_type must be 'chunked_nll' \| 'nll', got 'ce'"),
    (["--nan_policy", "ignore"], r"nan_policy must be 'skip' \| 'stop'"),
    (["--activation_offload", "some"], r"activation_offload must be true/false, an integer or 'auto'"),
    (["--bf16", "yes please"], r"bf16 must be true/false or 'auto'"),
    (["--model_init_kwargs", "[1, 2]"], r"model_init_kwargs must be a mapping or null"),
    (["--learning_rate", "fast"], r"learning_rate must be a number, got 'fast'"),
])
def test_type_errors_name_field_type_and_value(argv, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(argv)


def test_malformed_yaml_recipe_reports_line_and_column(tmp_path):
    r = _recipe(tmp_path, "max_length: 10\nlearning_rate: 0.1\nbf16: [true\nseed: 3\n")
    with pytest.raises(ConfigError, match=r"recipe .*recipe.yaml is not valid YAML at line \d+, column \d+"):
        load_config(["--config", r])
    r2 = _recipe(tmp_path, "max_length: 10\n  seed: 3\n")  # bad indentation on line 2
    with pytest.raises(ConfigError, match=r"at line 2, column 7"):
        load_config(["--config", r2])
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(["--config", _recipe(tmp_path, "- a\n- b\n")])
    with pytest.raises(ConfigError, match="not found"):
        load_config(["--config", str(tmp_path / "nope.yaml")])
    with pytest.raises(ConfigError, match=r"value of --model_init_kwargs .* not valid YAML"):
        load_config(["--model_init_kwargs", "{bad"])


def test_empty_recipe_gives_defaults(tmp_path):
    assert load_config(["--config", _recipe(tmp_path, "# nothing\n")]) == TrainConfig()


@pytest.mark.parametrize("overrides, world_size, pattern", [
    ({"max_steps": 0}, 2, r"max_steps must be > 0, got 0; use -1 \(or null\)"),
    ({"max_steps": -2}, 2, r"max_steps must be > 0, got -2"),
    ({"max_steps": None, "num_train_epochs": 0}, 2, r"num_train_epochs must be > 0"),
    ({"sp_size": 3}, 4, r"sp_size=3 does not divide the world size 4"),
    ({"learning_rate": -1e-4}, 1, r"learning_rate must be a finite number >= 0"),
    ({"loss_chunk_size": 0}, 1, r"loss_chunk_size must be >= 1, got 0"),
    ({"per_device_train_batch_size": 0}, 1, r"per_device_train_batch_size must be >= 1"),
    ({"gradient_accumulation_steps": 0}, 1, r"gradient_accumulation_steps must be >= 1"),
    ({"save_steps": 0}, 1, r"save_steps must be >= 1 \(or null\)"),
    ({"warmup_steps": -2}, 1, r"warmup_steps must be >= 0"),
    ({"adam_beta2": 1.0}, 1, r"adam_beta2 must be in \[0, 1\)"),
    ({"max_length": 1}, 1, r"max_length must be >= 2"),
    ({"tiled_mlp": 0}, 1, r"tiled_mlp must be >= 1 tiles"),
    ({"activation_offload": -1}, 1, r"activation_offload must be >= 0 layers"),
    ({"host_memory_gb": 0}, 1, r"host_memory_gb must be > 0"),
    ({"model_init_kwargs": {"torch_dtype": "bfloat16"}}, 1, r"may not set \['torch_dtype'\]: use the bf16"),
    ({"max_length": 1000, "pad_to_multiple_of": 64}, 1,
     r"max_length 1000 is not reachable with pad_to_multiple_of 64 and sp_size 1.*max_length 960 or 1024"),
    ({"max_length": 1208, "pad_to_multiple_of": 8, "sp_size": 3}, 3,
     r"sequences would be padded to a multiple of 24\); use max_length 1200 or 1224"),
    ({"max_length": 12, "pad_to_multiple_of": 16}, 1, r"use max_length 16, or set pad_to_multiple_of null"),
])
def test_validation_messages(overrides, world_size, pattern):
    cfg = TrainConfig(**overrides)
    with pytest.raises(ConfigError, match=pattern):
        validate_config(cfg, world_size)


def test_eval_on_local_data_needs_an_eval_dataset(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    cfg = TrainConfig(dataset_name=str(tmp_path / "d.jsonl"), eval_steps=2)
    with pytest.raises(ConfigError, match="set eval_dataset_name"):
        validate_config(cfg, 1)
    validate_config(TrainConfig(dataset_name=str(tmp_path / "d.jsonl"), eval_steps=2,
                                eval_dataset_name=str(tmp_path / "d.jsonl")), 1)
    validate_config(TrainConfig(eval_steps=2), 1)  # synthetic data makes its own eval documents


def test_eval_recall_probe_needs_evaluation():
    with pytest.raises(ConfigError, match="eval_recall_probe runs with evaluation, which is off: set eval_steps"):
        validate_config(TrainConfig(eval_recall_probe=True), 1)
    validate_config(TrainConfig(eval_recall_probe=True, eval_steps=2), 1)


def test_validation_accepts_good_shapes():
    validate_config(TrainConfig(max_length=4096, pad_to_multiple_of=64, sp_size=4), 8)
    validate_config(TrainConfig(max_length=1200, pad_to_multiple_of=8, sp_size=3), 3)  # 1200 = 50 x lcm 24
    validate_config(TrainConfig(max_steps=None, num_train_epochs=0.5), 1)
    validate_config(TrainConfig(activation_offload=0, tiled_mlp=4), 1)


def test_resolve_bf16():
    """One rule (Machine.bf16) for the trainer, `plan` and `rehearse`: auto = GPUs that take bf16."""
    from ulysses_trainer.plan.types import Machine

    cpu = Machine(gpus=2, gpu_memory_gb=None, host_memory_gb=16)
    gpu = Machine(gpus=2, gpu_memory_gb=80, host_memory_gb=16)
    assert cpu.bf16(TrainConfig(bf16="auto").bf16) is False and gpu.bf16("auto") is True
    assert cpu.bf16(True) is True and gpu.bf16(False) is False
    old = Machine(gpus=1, gpu_memory_gb=16, host_memory_gb=16, bf16_supported=False)  # e.g. a V100
    assert old.bf16("auto") is False


def test_config_dict_round_trip():
    cfg = load_config(["--model_init_kwargs", "{rope_parameters: {rope_type: yarn, factor: auto}}",
                       "--bf16", "true", "--max_steps", "9"])
    d = config_to_dict(cfg)
    assert json.loads(json.dumps(d)) == d
    assert config_from_dict(d) == cfg


def test_help_lists_every_field(capsys):
    text = format_help()
    for name in TrainConfig.__dataclass_fields__:
        assert f"--{name} " in text
    with pytest.raises(ConfigError, match="unexpected argument '-h'"):
        load_config(["-h"])  # the library parses; the command owns --help (cli/train.py)


def test_save_strategy_no_survives_yaml():
    # YAML 1.1 reads a bare `no` as false; the Literal field must still get "no"
    from ulysses_trainer.cli.argv import load_config

    assert load_config(["--save_strategy", "no"]).save_strategy == "no"
    assert load_config(["--save_strategy", "steps"]).save_strategy == "steps"
