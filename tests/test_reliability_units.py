"""The pieces behind docs/reliability.md's run-time rows, without processes: YAML numbers, TRL-name
suggestions, the output_dir check, the checkpoint writer under a failing disk, the resume comparison, the
data accounting, the CPU host-memory refusal and the order of the checks in prepare()."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from tests.tiny_checkpoint import write_checkpoint, write_documents
from ulysses_trainer.cli.argv import load_config
from ulysses_trainer.cli.train import main
from ulysses_trainer.config import config_to_dict
from ulysses_trainer.config.load import build_config
from ulysses_trainer.config.yaml_numbers import load_yaml
from ulysses_trainer.data.documents import build_sequences
from ulysses_trainer.data.tokenizer import load_tokenizer
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.train.checkpoint import previous_run
from ulysses_trainer.train.output_guard import RecordingWriter, check_writable, failure_message
from ulysses_trainer.train.resume_check import check_resume_config, compare, run_record


def test_yaml_numbers_read_as_a_user_means_them(tmp_path):
    assert load_yaml("a: 1e6\nb: 5e-5\nc: -2E4\nd: 1.5e+3\ne: 3\nf: abc\ng: 1e") == \
        {"a": 1e6, "b": 5e-5, "c": -2e4, "d": 1500.0, "e": 3, "f": "abc", "g": "1e"}
    cfg = load_config(["--model_init_kwargs", '{"rope_parameters": {"rope_type": "yarn", "factor": 4, '
                                               '"rope_theta": 1e6}}', "--learning_rate", "2e-5",
                       "--max_steps", "1e1"])
    assert cfg.model_init_kwargs["rope_parameters"]["rope_theta"] == 1e6
    assert cfg.learning_rate == 2e-5 and cfg.max_steps == 10 and isinstance(cfg.max_steps, int)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 1e-5\nmodel_init_kwargs: {rope_parameters: {rope_theta: 1e6}}\n")
    assert load_config(["--config", str(recipe)]).model_init_kwargs["rope_parameters"]["rope_theta"] == 1e6
    with pytest.raises(ConfigError, match="max_steps must be"):
        load_config(["--max_steps", "2.5"])


@pytest.mark.parametrize("name, setting", [("torch_dtype", "dtype"), ("evaluation_strategy", "eval_strategy"),
                                           ("activation_offloading", "activation_offload")])
def test_trl_names_point_at_this_trainers_setting(name, setting):
    with pytest.raises(ConfigError) as exc:
        load_config([f"--{name}", "1"])
    assert f"this trainer's setting for that is {setting}" in str(exc.value)


def test_output_dir_check_names_a_read_only_or_full_place(tmp_path):
    assert check_writable(str(tmp_path / "new" / "run"), 1024) is None
    full = check_writable(str(tmp_path / "run"), 1 << 60)
    assert full and "free" in full and "the run writes" in full and str(tmp_path) in full
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        problem = check_writable(str(ro / "run"), 1024)
        import os

        if os.geteuid() == 0:  # root writes through mode bits; the read-only mount is in the slow test
            assert problem is None
        else:
            assert problem and "is not writable" in problem
    finally:
        ro.chmod(0o700)


def test_writer_records_a_full_disk_and_writes_nothing_more():
    written = []

    class Engine:  # DeepSpeed's checkpoint engine as the writer sees it
        def save(self, sd, path):
            written.append(path)

        def makedirs(self, path, exist_ok=False):
            pass

        def commit(self, info):
            return "committed"

    def full_disk(sd, path):
        if path.endswith("optim_states.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(path)

    w = RecordingWriter(Engine(), write=full_disk)
    w.save({}, "/x/model_states.pt")
    w.save({}, "/x/optim_states.pt")  # fails: recorded, not raised (the collectives must go on)
    w.save({}, "/x/more.pt")
    assert written == ["/x/model_states.pt"]
    assert w.failure[:2] == ("/x/optim_states.pt", errno.ENOSPC)
    assert w.commit(None) == "committed"  # everything else is the real engine's
    msg = failure_message("checkpoint-2", "/out/.tmp-checkpoint-2", errno.ENOSPC)
    assert msg.startswith("cannot write checkpoint-2 to /out/.tmp-checkpoint-2: No space left on device;")


def test_a_run_that_only_wrote_config_json_blocks_nothing(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert previous_run(str(tmp_path)) == []
    (tmp_path / "metrics.jsonl").write_text("")
    assert previous_run(str(tmp_path)) == ["config.json", "metrics.jsonl"]


def _record(**changes) -> dict:
    return run_record(config_to_dict(build_config(overrides=changes)), 2, 2, 1)


def test_a_config_change_at_a_resume_goes_to_events_jsonl_not_between_the_training_rows(tmp_path):
    """metrics.jsonl holds training (and eval) rows, each with its loss; the change is an event, in events.jsonl,
    and both files drop what lies past the checkpoint's step."""
    from types import SimpleNamespace

    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.train.run_log import RunLog

    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 - s / 10}) + "\n" for s in (1, 2, 3)))
    (out / "events.jsonl").write_text(json.dumps({"step": 3, "config_change": {"learning_rate": [1, 2]}}) + "\n")
    from ulysses_trainer.families.presets import preset_config

    plan = SimpleNamespace(cfg=TrainConfig(output_dir=str(out), report_to="none"), reporters=[],
                           model_config=preset_config("tiny"))
    run_log = RunLog(plan, True)
    run_log.resume_at(2, str(out / "checkpoint-2"), {"learning_rate": (1e-4, 5e-5)})
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics == [{"step": 1, "loss": 2.9}, {"step": 2, "loss": 2.8}]  # every row a training row with loss
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert events == [{"step": 2, "config_change": {"learning_rate": [1e-4, 5e-5]}}]


def test_resume_comparison_refuses_what_breaks_exactness_naming_both_values(tmp_path):
    saved = _record(max_length=64)
    breaking, harmless = compare(saved, _record(max_length=128, logging_steps=5, learning_rate=5e-5))
    assert breaking == {"max_length": (64, 128)}
    assert harmless == {"logging_steps": (1, 5), "learning_rate": (1e-4, 5e-5)}
    moved = run_record(saved["config"], 2, 1, 2)  # same config, sp 2 x dp 1 -> sp 1 x dp 2
    assert compare(saved, moved)[0] == {"sp_size": (2, 1), "dp_size": (1, 2)}
    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    (ckpt / "run_config.json").write_text(json.dumps(saved))
    for field, value in (("seed", 7), ("dataset_name", "other.jsonl"), ("model_name_or_path", "qwen3-0.6b")):
        with pytest.raises(ConfigError, match=f"{field}: .* in the checkpoint, .* now"):
            check_resume_config(str(ckpt), _record(max_length=64, **{field: value}), allow_change=False)
    with pytest.raises(ConfigError, match=r"max_length: 64 in the checkpoint, 128 now.*allow_config_change true"):
        check_resume_config(str(ckpt), _record(max_length=128), allow_change=False)
    assert check_resume_config(str(ckpt), _record(max_length=128), allow_change=True) == {"max_length": (64, 128)}
    assert check_resume_config(str(ckpt), _record(max_length=64, save_steps=3), allow_change=False) == \
        {"save_steps": (None, 3)}
    # verify_sp runs on a private copy before step 1: a resume may turn it off (or on); nothing to record
    assert check_resume_config(str(ckpt), _record(max_length=64, verify_sp=False), allow_change=False) == {}


def test_data_accounting_counts_skipped_records_and_the_tail(tmp_path):
    model = write_checkpoint(tmp_path / "model")
    tok = load_tokenizer(str(model))
    docs = tmp_path / "mixed.jsonl"
    lines = [json.dumps({"text": "alpha bravo charlie"}) if i % 2 == 0 else json.dumps({"content": "x"})
             for i in range(30)] + [json.dumps({"text": ""})]
    docs.write_text("\n".join(lines) + "\n")
    cfg = build_config(overrides={"model_name_or_path": str(model), "dataset_name": str(docs), "max_length": 16})
    data = build_sequences(cfg, tok)
    c = data.counts
    # 15 documents of 3 words + eos = 60 tokens -> 3 rows of 16, 12 tokens dropped
    assert (c.documents_read, c.documents_used, c.tokens, c.sequences) == (31, 15, 60, 3)
    assert c.skipped == {"without the text field (missing or null)": 15, "empty text": 1}
    assert (c.tail, c.tail_tokens) == ("dropped", 12) and len(data) == 3
    assert "15 without the text field" in c.summary() and "last 12 tokens dropped" in c.summary()

    padded = build_sequences(build_config(overrides={**cfg.__dict__, "pad_last_sequence": True}), tok)
    assert len(padded) == 4 and (padded.counts.tail, padded.counts.pad_tokens) == ("padded", 4)
    last = padded[3]
    assert (last["labels"][:12] == last["input_ids"][:12]).all() and (last["labels"][12:] == -100).all()
    assert (padded[2]["labels"] == padded[2]["input_ids"]).all()  # full rows train on every token
    assert (padded[2]["input_ids"] == data[2]["input_ids"]).all()
    # the padded row's real length travels with it: num_tokens and the router statistics leave its pads out
    assert (last["real_tokens"], padded.real_tokens(3), padded[2]["real_tokens"]) == (12, 12, 16)


def _main(argv, monkeypatch, capsys) -> tuple[int, list[str]]:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    rc = main(argv)
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def test_missing_data_is_reported_before_an_occupied_output_dir(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    rc, errors = _main(["--dataset_name", str(tmp_path / "nope.jsonl"), "--output_dir", str(out)], monkeypatch,
                       capsys)
    assert rc == 2 and len(errors) == 1 and "nope.jsonl' not found" in errors[0]


def test_cpu_run_that_exceeds_host_memory_is_refused_with_the_plans_numbers(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    rc, errors = _main(["--model_name_or_path", "qwen3-4b", "--max_length", "262144", "--bf16", "true",
                        "--model_init_kwargs", "{rope_parameters: {rope_type: yarn, factor: auto}}",
                        "--host_memory_gb", "24", "--output_dir", str(out)], monkeypatch, capsys)
    assert rc == 2 and len(errors) == 1
    assert "GiB of host memory on this CPU machine" in errors[0] and "lower max_length (now 262144)" in errors[0]
    assert not out.exists()


def test_rehearsal_prepare_ignores_an_occupied_output_dir(tmp_path):
    from ulysses_trainer.train.prepare import prepare

    model = write_checkpoint(tmp_path / "model")
    docs = write_documents(tmp_path / "docs.jsonl", num_docs=8, words_per_doc=31)
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    cfg = build_config(overrides={"model_name_or_path": str(model), "dataset_name": str(docs), "max_length": 32,
                                  "output_dir": str(out), "max_steps": 1})
    with pytest.raises(ConfigError, match="holds a previous run"):
        prepare(cfg, 1)
    assert prepare(cfg, 1, training=False).total_steps == 1
    assert Path(out / "metrics.jsonl").read_text() == "{}\n"
