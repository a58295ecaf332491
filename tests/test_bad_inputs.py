"""Every bad input ends the run before any heavy work: exit code 2, one `error:` line naming the fix,
and nothing written to output_dir (it is not even created).

Most cases call the command's own entry point, `ulysses_trainer.cli.train.main(argv)`, in-process
(the function `launch/train.py` runs on every rank; WORLD_SIZE/RANK set as the launcher sets them).
A few run the real command as a subprocess: `python launch/train.py`, and `deepspeed --num_gpus 2
launch/train.py`, which must also exit 2 with the message printed once, not once per rank.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import JOB_TIMEOUT_S, train_command, train_env
from tests.tiny_checkpoint import write_checkpoint, write_documents
from ulysses_trainer.attention.kernels import available_kernels
from ulysses_trainer.cli.train import main
from ulysses_trainer.families.presets import preset_config
from ulysses_trainer.levers.lean_norm import available_norm_kernels

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The bad (and a few good) inputs the cases point at."""
    d = tmp_path_factory.mktemp("inputs")
    f = {}
    f["bad_json"] = d / "bad.json"
    f["bad_json"].write_text('{\n  "train_batch_size": "auto",\n  "zero_optimization": {"stage": }\n}\n')
    f["clip_json"] = d / "clip.json"
    f["clip_json"].write_text(json.dumps({"gradient_clipping": 0.5, "zero_optimization": {"stage": 3}}))
    f["empty"] = d / "empty.jsonl"
    f["empty"].write_text("")
    f["content"] = d / "content.jsonl"
    f["content"].write_text("".join(json.dumps({"content": "some words " * 50}) + "\n" for _ in range(4)))
    f["short"] = d / "short.jsonl"
    f["short"].write_text(json.dumps({"text": "hello world"}) + "\n")
    f["bad_parquet"] = d / "bad.parquet"
    f["bad_parquet"].write_bytes(b"this is not a parquet file\n" * 4)
    f["words"] = write_checkpoint(d / "words")  # a good small checkpoint with its own tokenizer
    f["words_docs"] = write_documents(d / "words.jsonl", num_docs=8, words_per_doc=31)
    f["yarn_ckpt"] = write_checkpoint(d / "yarn", max_position_embeddings=512, rope_parameters={  # scaled down
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "rope_theta": 1e6})
    f["kv3"] = write_checkpoint(d / "kv3", num_attention_heads=6, num_key_value_heads=3)
    f["no_weights"] = d / "no_weights"
    shutil.copytree(f["words"], f["no_weights"])
    (f["no_weights"] / "model.safetensors").unlink()
    f["cut_weights"] = d / "cut_weights"
    shutil.copytree(f["words"], f["cut_weights"])
    w = f["cut_weights"] / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])  # an interrupted download
    f["broken_line"] = d / "broken.jsonl"  # line 3 is cut short
    f["broken_line"].write_text('{"text": "one"}\n{"text": "two"}\n{"text": "thr\n{"text": "four"}\n')
    f["list_line"] = d / "list.jsonl"
    f["list_line"].write_text('{"text": "one"}\n\n[1, 2]\n')
    f["run_out"] = d / "run_out"  # what a training run leaves: its config.json is not a model's
    (f["run_out"] / "checkpoint-4").mkdir(parents=True)
    (f["run_out"] / "checkpoint-4" / "ulysses_trainer_checkpoint").write_text("")
    (f["run_out"] / "config.json").write_text(json.dumps({"model_name_or_path": "tiny", "max_length": 64}))
    (f["run_out"] / "latest").write_text("checkpoint-4\n")
    (f["run_out"] / "metrics.jsonl").write_text('{"step": 4, "loss": 3.0}\n')
    f["bad_config"] = d / "bad_config"
    shutil.copytree(f["words"], f["bad_config"])
    (f["bad_config"] / "config.json").write_text('{"model_type": "qwen3", ')
    f["bad_tokenizer"] = d / "bad_tokenizer"
    shutil.copytree(f["words"], f["bad_tokenizer"])
    (f["bad_tokenizer"] / "tokenizer.json").write_text("{not json")
    f["not_a_checkpoint"] = d / "not_a_checkpoint"
    f["not_a_checkpoint"].mkdir()
    f["latin1"] = d / "latin1" / "book.txt"
    f["latin1"].parent.mkdir()
    f["latin1"].write_bytes(("Il \u00e9tait une fois.\n\n" * 40).encode("latin-1"))
    f["stage2_json"] = d / "stage2.json"
    f["stage2_json"].write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    f["ds_rejects_json"] = d / "ds_rejects.json"
    f["ds_rejects_json"].write_text(json.dumps({"zero_optimization": {"stage": 3,
                                                                      "offload_optimizer": {"device": "gpu"}}}))
    # a checkpoint of another model size (the file save_checkpoint writes beside the shards)
    f["other_size_ckpt"] = d / "other_run" / "checkpoint-2"
    (f["other_size_ckpt"] / "ds").mkdir(parents=True)
    other = preset_config("tiny")
    other.hidden_size, other.num_hidden_layers = 128, 4
    (f["other_size_ckpt"] / "model_config.json").write_text(other.to_json_string())
    return f


def _yarn(**kw) -> list[str]:
    return ["--model_init_kwargs", json.dumps({"rope_parameters": {"rope_type": "yarn", **kw}})]


# name: (argv from the files, world size, pattern the one error line must match)
CASES = {
    "malformed_zero_json": (lambda f: ["--deepspeed", str(f["bad_json"])], 1,
                            r"ZeRO config .*bad\.json is not valid at line 3, column 34: .*fix the syntax"),
    "unknown_name": (lambda f: ["--learning_rat", "1e-4"], 1,
                     r"unknown config name 'learning_rat' \(command line\); did you mean 'learning_rate'\?"),
    "unknown_name_in_recipe": (lambda f: ["--config", str(_recipe(f, "gradient_acumulation_steps: 2\n"))], 1,
                               r"unknown config name 'gradient_acumulation_steps' \(in recipe .*\); "
                               r"did you mean 'gradient_accumulation_steps'\?"),
    "zero_json_conflicts_with_config": (
        lambda f: ["--deepspeed", str(f["clip_json"])], 1,
        r"gradient_clipping is 0\.5 in .*clip\.json but the training config gives max_grad_norm = 1\.0 \(from the "
        r"default\); set it to \"auto\" in the JSON or set max_grad_norm 0\.5"),
    "sp_size_vs_world_size": (lambda f: ["--sp_size", "3"], 2,
                              r"sp_size=3 does not divide the world size 2; use one of \[1, 2\]"),
    "sp_vs_query_heads": (lambda f: ["--model_init_kwargs", '{"num_attention_heads": 3, "num_key_value_heads": 1}',
                                     "--sp_size", "2"], 2,
                          r"sp_size=2 does not divide the model's 3 query heads; sp_size values that work "
                          r"for this model: \[1, 3\]"),
    "sp_vs_kv_heads": (lambda f: ["--model_name_or_path", str(f["kv3"]), "--sp_size", "2"], 2,
                       r"sp_size=2 neither divides nor is a multiple of the model's 3 KV heads; sp_size values "
                       r"that work for this model: \[1, 3, 6\]"),
    "max_length_vs_pad_to_multiple_of": (
        lambda f: ["--max_length", "1000", "--pad_to_multiple_of", "64"], 1,
        r"max_length 1000 is not reachable with pad_to_multiple_of 64 and sp_size 1 .*use max_length 960 or "
        r"1024, or set pad_to_multiple_of null"),
    "model_path_missing": (lambda f: ["--model_name_or_path", str(f["words"]) + "_nope"], 1,
                           r"model_name_or_path '.*words_nope': no such path; use a preset \(tiny, "),
    "model_dir_without_config": (lambda f: ["--model_name_or_path", str(f["not_a_checkpoint"])], 1,
                                 r"model_name_or_path '.*not_a_checkpoint': the directory has no config\.json"),
    "model_config_unreadable": (lambda f: ["--model_name_or_path", str(f["bad_config"])], 1,
                                r"cannot read .*bad_config/config\.json: .*; fix the file or copy the "
                                r"checkpoint again"),
    "model_is_a_training_output_dir": (
        lambda f: ["--model_name_or_path", str(f["run_out"])], 1,
        r"model_name_or_path '.*run_out': .*run_out is a training output_dir, not a Hugging Face model; its "
        r"exported model is .*run_out/final .*set model_name_or_path to .*run_out/final"),
    "model_is_a_training_checkpoint": (
        lambda f: ["--model_name_or_path", str(f["run_out"] / "checkpoint-4")], 1,
        r"checkpoint-4 is a training checkpoint \(ZeRO shards and optimizer state for resume_from_checkpoint\), "
        r"not a Hugging Face model; train from the model the run exported, .*run_out/final .*--resume_from_checkpoint"),
    "model_weights_missing": (lambda f: ["--model_name_or_path", str(f["no_weights"])], 1,
                              r"model_name_or_path '.*no_weights' holds no weights \(none of model\.safetensors, "
                              r".*\); copy the checkpoint's weight files there"),
    "model_weights_unreadable": (lambda f: ["--model_name_or_path", str(f["cut_weights"])], 1,
                                 r"cannot read the weights .*cut_weights/model\.safetensors: .*; re-download"),
    "tokenizer_unreadable": (lambda f: ["--model_name_or_path", str(f["bad_tokenizer"])], 1,
                             r"cannot load the tokenizer in .*bad_tokenizer: .*fix or remove its tokenizer files"),
    "data_path_missing": (lambda f: ["--dataset_name", str(f["empty"].with_name("nope.jsonl"))], 1,
                          r"dataset '.*nope\.jsonl' not found; give an existing file or directory"),
    "data_jsonl_line_broken": (lambda f: ["--dataset_name", str(f["broken_line"])], 1,
                               r"dataset file .*broken\.jsonl, line 3: not valid JSON \(.* at column \d+\); each "
                               r"line of a JSON Lines file must be one JSON object, .*: fix or remove that line"),
    "data_jsonl_line_not_an_object": (lambda f: ["--dataset_name", str(f["list_line"])], 1,
                                      r"dataset file .*list\.jsonl, line 3: a JSON list, not an object; .*fix or "
                                      r"remove that line"),
    "data_unreadable": (lambda f: ["--dataset_name", str(f["bad_parquet"])], 1,
                        r"cannot read dataset .*bad\.parquet as parquet"),
    "tokenizer_vocab_exceeds_model": (lambda f: ["--model_init_kwargs", '{"vocab_size": 1000}'], 1,
                                      r"tokenizer qwen-bpe .* has 151669 ids but the model's vocab_size is 1000; "
                                      r"use the model's own tokenizer or a model with a larger vocabulary"),
    "rope_theta_mismatch": (lambda f: _yarn(factor=4, rope_theta=10000), 1,
                            r"rope_parameters\.rope_theta 10000 differs from the checkpoint's rope_theta "
                            r"1000000\.0.*drop rope_theta from rope_parameters"),
    "yarn_factor_one": (lambda f: _yarn(factor=1.0) + ["--max_length", "81920"], 1,
                        r"YaRN factor must be > 1, got 1; use factor auto"),
    "yarn_factor_below_one": (lambda f: _yarn(factor=0.5) + ["--max_length", "81920"], 1,
                              r"YaRN factor must be > 1, got 0\.5"),
    "yarn_original_longer_than_target": (
        lambda f: _yarn(original_max_position_embeddings=8192) + ["--max_length", "4096"], 1,
        r"YaRN original_max_position_embeddings 8192 exceeds the target length max_length 4096.*drop "
        r"rope_parameters .* or raise max_length"),
    "max_length_beyond_positions": (
        lambda f: ["--max_length", "65536"], 1,
        r"max_length 65,536 is beyond the model's positions: max_position_embeddings is 40,960 and it has no rope "
        r"scaling; stretch them with YaRN to max_length: --model_init_kwargs "
        r"'\{\"rope_parameters\": \{\"rope_type\": \"yarn\", \"factor\": \"auto\"\}\}', or set "
        r"allow_beyond_positions true to train past them anyway"),
    "max_length_beyond_the_checkpoints_own_yarn": (
        lambda f: ["--model_name_or_path", str(f["yarn_ckpt"]), "--dataset_name", str(f["words_docs"]),
                   "--max_length", "4096"], 1,
        r"max_length 4,096 is beyond the model's positions: the checkpoint's own yarn scaling \(factor 4\) covers "
        r"2,048; stretch them with YaRN to max_length: --model_init_kwargs .*\"factor\": \"auto\".*, or set "
        r"allow_beyond_positions true"),
    "dataset_empty": (lambda f: ["--dataset_name", str(f["empty"])], 1,
                      r"dataset .*empty\.jsonl is empty; point dataset_name at data with documents"),
    "text_field_missing": (lambda f: ["--dataset_name", str(f["content"])], 1,
                           r"dataset .*content\.jsonl has no field 'text'; its fields are \['content'\], none of "
                           r"the accepted forms. Accepted: a text column .*dataset_text_field.*`messages`.*`prompt`"),
    "documents_too_short": (lambda f: ["--dataset_name", str(f["short"]), "--max_length", "256"], 1,
                            r"dataset .*short\.jsonl gives 3 tokens \(1 documents \+ eos\) but one sequence "
                            r"needs max_length = 256 tokens"),
    "documents_too_few_for_one_step": (
        lambda f: ["--model_name_or_path", str(f["words"]), "--dataset_name", str(f["words_docs"]),
                   "--max_length", "32", "--gradient_accumulation_steps", "16"], 1,
        r"the data makes 8 sequences of 32 tokens but one optimizer step needs 16"),
    "keep_attention_outputs_beyond_layers": (lambda f: ["--keep_attention_outputs", "99"], 1,
                                             r"keep_attention_outputs=99 exceeds the model's \d+ layers; give "
                                             r"0\.\.\d+, true \(all of them\) or auto"),
    "keep_attention_outputs_without_checkpointing": (
        lambda f: ["--gradient_checkpointing", "false", "--keep_attention_outputs", "true"], 1,
        r"keep_attention_outputs needs gradient_checkpointing: true \(only a recompute reuses them\)"),
    "activation_offload_without_checkpointing": (
        lambda f: ["--gradient_checkpointing", "false", "--activation_offload", "true"], 1,
        r"activation_offload true needs gradient_checkpointing: true \(it offloads the layer checkpoints\); set "
        r"activation_offload false or gradient_checkpointing true"),
    "max_steps_zero": (lambda f: ["--max_steps", "0"], 1, r"max_steps must be > 0, got 0"),
    "max_steps_negative": (lambda f: ["--max_steps", "-3"], 1, r"max_steps must be > 0, got -3"),
    "epochs_zero": (lambda f: ["--max_steps", "null", "--num_train_epochs", "0"], 1,
                    r"num_train_epochs must be > 0 when max_steps is null, got 0"),
    "resume_path_without_checkpoint": (
        lambda f: ["--resume_from_checkpoint", str(f["not_a_checkpoint"])], 1,
        r"resume_from_checkpoint: .*not_a_checkpoint holds no checkpoint \(expected .*/ds/\); pass an "
        r"output_dir/checkpoint-<step> directory or `latest`"),
    "txt_not_utf8": (lambda f: ["--dataset_name", str(f["latin1"].parent)], 1,
                     r"dataset file .*latin1/book\.txt is not UTF-8 text \(byte 3\); convert it to UTF-8"),
    "zero_stage_2": (lambda f: ["--deepspeed", str(f["stage2_json"])], 1,
                     r".*stage2\.json has zero_optimization\.stage 2, but this trainer needs ZeRO stage 3 .*; set "
                     r"\"zero_optimization\": \{\"stage\": 3\}"),
    "zero_json_rejected_by_deepspeed": (
        lambda f: ["--deepspeed", str(f["ds_rejects_json"])], 1,
        r"DeepSpeed rejects .*ds_rejects\.json: zero_optimization\.offload_optimizer\.device = \"gpu\": Input "
        r"should be 'none', 'cpu' or 'nvme'; fix or remove that field"),
    "resume_from_another_model_size": (
        lambda f: ["--resume_from_checkpoint", str(f["other_size_ckpt"])], 1,
        r"resume_from_checkpoint: .*checkpoint-2 holds a model of hidden 128, 4 layers, .* but this run builds "
        r"hidden 64, 2 layers, .*; resume with the model_name_or_path and model_init_kwargs of the run that "
        r"wrote it"),
    "resume_latest_without_checkpoint": (lambda f: ["--resume_from_checkpoint", "true"], 1,
                                         r"resume_from_checkpoint=True: no checkpoint in .* \(no `latest` file\)"),
}
for _kernel in ("flash_attention_2", "flash_attention_4"):
    CASES[f"{_kernel}_not_installed"] = (
        lambda f, k=_kernel: ["--attn_implementation", k], 1,
        rf"attn_implementation='{_kernel}' is not installed here \(.*\); installed: sdpa")
CASES["norm_kernel_triton_not_installed"] = (  # CPU: the fused RMSNorm needs CUDA
    lambda f: ["--norm_kernel", "triton"], 1,
    r"norm_kernel='triton' is not installed here \(pip install 'ulysses_trainer\[liger\]'.*\); installed: torch")


def _recipe(f: dict[str, Path], text: str) -> Path:
    p = f["empty"].with_name("recipe.yaml")
    p.write_text(text)
    return p


def _tree(path: Path) -> dict[str, bytes] | None:
    """Every file under path with its bytes (None when path does not exist)."""
    if not path.exists():
        return None
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _run_main(argv: list[str], world_size: int, monkeypatch, capsys) -> tuple[int, list[str]]:
    if world_size > 1:  # as rank 0 of a launcher's world, without its peers: no process group to start
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setattr("ulysses_trainer.cli.train._init_distributed", lambda: None)
    else:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        monkeypatch.delenv("RANK", raising=False)
    rc = main(argv)
    err = capsys.readouterr().err
    return rc, [line for line in err.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_exits_2_with_one_message_and_no_output_dir(name, files, tmp_path, monkeypatch, capsys):
    argv_of, world_size, pattern = CASES[name]
    if name.startswith("flash_attention") and name.removesuffix("_not_installed") in available_kernels():
        pytest.skip("installed here")
    if name.startswith("norm_kernel") and "triton" in available_norm_kernels():
        pytest.skip("installed here")
    out = tmp_path / "out"
    rc, errors = _run_main(argv_of(files) + ["--output_dir", str(out)], world_size, monkeypatch, capsys)
    assert rc == 2
    assert len(errors) == 1, errors
    assert re.search(pattern, errors[0]), errors[0]
    assert not out.exists()


def test_bad_input_leaves_an_existing_output_dir_untouched(files, tmp_path, monkeypatch, capsys):
    """A previous run's output_dir (checkpoints, metrics) is not touched by a rejected command."""
    out = tmp_path / "out"
    (out / "checkpoint-2" / "ds").mkdir(parents=True)
    (out / "checkpoint-2" / "ds" / "shard.pt").write_bytes(b"\x00" * 64)
    (out / "latest").write_text("checkpoint-2\n")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n')
    before = _tree(out)
    for argv in (["--max_steps", "0"], ["--dataset_name", str(files["empty"])],
                 ["--resume_from_checkpoint", str(files["not_a_checkpoint"])]):
        rc, errors = _run_main(argv + ["--output_dir", str(out)], 1, monkeypatch, capsys)
        assert rc == 2 and len(errors) == 1
        assert _tree(out) == before


def test_output_dir_holding_a_previous_run_is_refused_untouched(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    (out / "checkpoint-2" / "ds").mkdir(parents=True)
    (out / "latest").write_text("checkpoint-2\n")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    (out / "config.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    before = _tree(out)
    rc, errors = _run_main(["--output_dir", str(out)], 1, monkeypatch, capsys)
    assert rc == 2 and len(errors) == 1
    assert re.search(r"output_dir .*out holds a previous run \(checkpoint-2, config\.json, latest, metrics\.jsonl\); "
                     r"resume it with resume_from_checkpoint true, set overwrite_output_dir true", errors[0])
    assert _tree(out) == before
    # resuming it, or overwrite_output_dir, passes the check (clearing only the run's files, later)
    from ulysses_trainer.train.checkpoint import check_output_dir, clear_previous_run

    assert check_output_dir(str(out), str(out / "checkpoint-2"), overwrite=False) is False
    assert check_output_dir(str(out), None, overwrite=True) is True
    (out / "checkpoint-2" / "ulysses_trainer_checkpoint").write_text("")  # what the trainer writes into its own
    (out / "checkpoint-best").mkdir()  # a user's: not a checkpoint-<step>, never removed
    (out / "checkpoint-best" / "keep.txt").write_text("mine")
    (out / "runs").mkdir()
    (out / "runs" / "events.out.tfevents.1.host").write_bytes(b"old curve")
    (out / "runs" / "notes.txt").write_text("mine")
    clear_previous_run(str(out))
    assert _tree(out) == {"notes.txt": b"mine", "checkpoint-best/keep.txt": b"mine", "runs/notes.txt": b"mine"}
    assert check_output_dir(str(out), None, overwrite=False) is False  # nothing of a run left


def test_output_dir_that_is_a_file(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    out.write_text("not a directory")
    for target in (out, out / "run"):
        rc, errors = _run_main(["--output_dir", str(target)], 1, monkeypatch, capsys)
        assert rc == 2 and len(errors) == 1
        assert re.search(r"output_dir .*out(/run lies under .*out, which)? is a file; set output_dir to a "
                         r"directory path", errors[0]), errors[0]
    assert out.read_text() == "not a directory"


def test_ctrl_c_while_checking_inputs_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    import ulysses_trainer.train.prepare as prepare_module

    def interrupted(cfg, world_size):  # Ctrl-C lands while the data is tokenized
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "prepare", interrupted)
    monkeypatch.delenv("RANK", raising=False)
    rc = main(["--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 130
    assert err.strip() == "[ulysses_trainer] interrupted before training: nothing written"


def test_help_lists_config_and_prints_only_on_rank_0(monkeypatch, capsys):
    for rank, shown in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        assert main(["--help"]) == 0
        out = capsys.readouterr().out
        assert ("--config (a path" in out and "--overwrite_output_dir" in out) == shown
        assert (out == "") != shown


# ---------------------------------------------------------------- the real command
def _command(args: list[str], launcher: bool) -> subprocess.CompletedProcess:
    cmd = train_command(2, args) if launcher else [sys.executable, "launch/train.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("launcher,args_of,pattern", [
    pytest.param(False, lambda f: ["--max_steps", "0"], r"^error: max_steps must be > 0, got 0;",
                 id="python-max_steps"),
    pytest.param(False, lambda f: ["--dataset_name", str(f["content"])], r"^error: dataset .* has no field 'text'",
                 id="python-text_field"),
    pytest.param(False, lambda f: ["--deepspeed", str(f["stage2_json"])],
                 r"^error: .*stage2\.json has zero_optimization\.stage 2, but this trainer needs ZeRO stage 3",
                 id="python-zero_stage_2"),
    pytest.param(False, lambda f: ["--dataset_name", str(f["latin1"])],
                 r"^error: dataset file .*book\.txt is not UTF-8 text \(byte 3\); convert it to UTF-8",
                 id="python-latin1_txt"),
    pytest.param(True, lambda f: ["--sp_size", "3"],
                 r"^error: sp_size=3 does not divide the world size 2; use one of \[1, 2\]",
                 id="deepspeed-sp_size"),
    pytest.param(True, lambda f: ["--deepspeed", str(f["bad_json"])],
                 r"^error: ZeRO config .*bad\.json is not valid at line 3, column 34",
                 id="deepspeed-zero_json"),
    pytest.param(True, lambda f: ["--model_init_kwargs", '{"num_attention_heads": 3, "num_key_value_heads": 1}'],
                 r"^error: sp_size=2 does not divide the model's 3 query heads",
                 id="deepspeed-heads"),
])
def test_real_command_exits_2_and_prints_once(launcher, args_of, pattern, files, tmp_path):
    out = tmp_path / "out"
    proc = _command(args_of(files) + ["--output_dir", str(out)], launcher)
    lines = (proc.stdout + proc.stderr).splitlines()
    errors = [line for line in lines if "error:" in line and "[ERROR]" not in line]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1, errors  # once, not once per rank
    assert re.search(pattern, errors[0]), errors[0]
    assert not any("Traceback" in line for line in lines), proc.stderr[-3000:]
    assert not out.exists()


@pytest.mark.slow
def test_help_under_deepspeed_prints_once_and_lists_config():
    proc = subprocess.run(train_command(2, ["--help"]), cwd=ROOT, env=train_env(), capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("usage: deepspeed") == 1, proc.stdout[-3000:]
    assert "--config (a path" in proc.stdout and "--max_eval_samples" in proc.stdout
