"""report_to: the metrics.jsonl rows also written as TensorBoard events (read back with tensorboard's own
event reader) or to wandb; bad values exit 2 before any work."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tests.dist_utils import JOB_TIMEOUT_S, job_failure
from tests.warm_ranks import run_trainer
from ulysses_trainer.cli.train import main
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.train.run_log import Reporters
from ulysses_trainer.vocabulary import names
from ulysses_trainer.vocabulary.names import resolve_report_to

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("tensorboard", reason="the dev extra installs tensorboard")


def read_events(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} as TensorBoard itself loads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def f32(x: float) -> float:
    return float(np.float32(x))  # TensorBoard stores scalars as float32


def test_tensorboard_reporter_writes_train_and_eval_rows_and_a_resume_replaces_later_steps(tmp_path):
    rows = [{"step": s, "loss": 10.0 / s + 1e-7, "grad_norm": 2.5 * s, "learning_rate": 1e-4, "num_tokens": 512 * s}
            for s in (1, 2, 3, 4)]
    first = Reporters(["tensorboard"], str(tmp_path), {})
    assert not (tmp_path / "runs").exists()  # nothing written before the first row
    for row in rows:
        first.log(row)
    first.log({"step": 4, "eval_loss": 3.25})
    first.close()
    ev = read_events(tmp_path / "runs")
    assert set(ev) == {"train/loss", "train/grad_norm", "train/learning_rate", "train/num_tokens", "eval/loss"}
    assert ev["train/loss"] == [(r["step"], f32(r["loss"])) for r in rows]
    assert ev["train/num_tokens"] == [(s, 512.0 * s) for s in (1, 2, 3, 4)]
    assert ev["eval/loss"] == [(4, 3.25)]

    # resumed from step 2: steps 3 and 4 are logged again with other values; each step appears once
    again = Reporters(["tensorboard"], str(tmp_path), {})
    again.resume_at(2)
    for s in (3, 4):
        again.log({"step": s, "loss": 100.0 + s})
    again.close()
    ev = read_events(tmp_path / "runs")
    assert ev["train/loss"] == [(1, f32(rows[0]["loss"])), (2, f32(rows[1]["loss"])), (3, 103.0), (4, 104.0)]
    assert ev.get("eval/loss", []) == []  # its step 4 was past the checkpoint too


def test_resolve_report_to(monkeypatch):
    installed = {"tensorboard": True, "wandb": False}
    monkeypatch.setattr(names, "_installed", lambda name: installed[name])
    assert resolve_report_to("auto") == ["tensorboard"]
    assert resolve_report_to("all") == ["tensorboard"]
    assert resolve_report_to("none") == [] and resolve_report_to([]) == []
    assert resolve_report_to(["tensorboard", "tensorboard"]) == ["tensorboard"]
    with pytest.raises(ConfigError, match=r"report_to wandb needs the wandb package: pip install wandb"):
        resolve_report_to(["tensorboard", "wandb"])
    with pytest.raises(ConfigError, match=r"report_to 'tensorbord' is not supported; use none, tensorboard"):
        resolve_report_to("tensorbord")
    installed["tensorboard"] = False
    assert resolve_report_to("auto") == []
    with pytest.raises(ConfigError, match=r"report_to tensorboard needs the tensorboard package"):
        resolve_report_to("tensorboard")


@pytest.mark.parametrize("value,pattern", [
    ("tensorbord", r"^error: report_to 'tensorbord' is not supported"),
    ("[tensorboard, mlflow]", r"^error: report_to 'mlflow' is not supported"),
])
def test_bad_report_to_exits_2_before_any_work(value, pattern, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "out"
    assert main(["--report_to", value, "--output_dir", str(out)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(pattern, errors[0]), errors
    assert not out.exists()


def test_report_to_is_decoded_once_in_prepare_and_the_trainer_reads_it(tmp_path, monkeypatch):
    """prepare decodes report_to into PreparedRun.reporters; no other module of the package calls the decoder."""
    import ast

    from ulysses_trainer.cli.argv import load_config
    from ulysses_trainer.train.prepare import prepare

    installed = {"tensorboard": True, "wandb": False}
    monkeypatch.setattr(names, "_installed", lambda name: installed[name])
    run = prepare(load_config(["--max_length", "64", "--output_dir", str(tmp_path / "out")]), 1)
    assert run.reporters == ["tensorboard"]  # `auto` with tensorboard installed
    installed["tensorboard"] = False
    run = prepare(load_config(["--max_length", "64", "--output_dir", str(tmp_path / "out")]), 1)
    assert run.reporters == []
    callers = set()
    for path in (ROOT / "ulysses_trainer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) \
                    == "resolve_report_to":
                callers.add(path.relative_to(ROOT).as_posix())
    assert callers == {"ulysses_trainer/train/prepare.py"}, callers


@pytest.mark.slow
def test_real_command_report_to_tensorboard_has_the_losses_of_metrics_jsonl(tmp_path):
    out = tmp_path / "out"
    args = ["--report_to", "tensorboard", "--max_steps", "2", "--max_length", "128", "--bf16", "false",
            "--eval_steps", "2", "--save_strategy", "no", "--output_dir", str(out)]
    proc = run_trainer(1, args, timeout=JOB_TIMEOUT_S)  # the launched rank's entry, forked (tests/warm_ranks.py)
    assert proc.returncode == 0, job_failure(proc)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in train] == [1, 2] and [r["step"] for r in evals] == [2]
    assert list((out / "runs").glob("events.out.tfevents.*"))
    ev = read_events(out / "runs")
    for key in ("loss", "grad_norm", "learning_rate", "num_tokens", "epoch", "tokens_per_s"):
        assert ev[f"train/{key}"] == [(r["step"], f32(r[key])) for r in train], key
    assert ev["eval/loss"] == [(2, f32(evals[0]["eval_loss"]))]


def read_wandb_history(run_file: Path) -> dict[int, dict[str, float]]:
    """{step: {tag: value}} from an offline run's .wandb file: a LevelDB-style log (7-byte file header, 32 KiB
    blocks, records of crc32 / length / type + payload, split across blocks) of wandb Record protos."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, part, history = run_file.read_bytes(), 32768, 7, b"", {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                items = {k: v for k, v in items.items() if not k.startswith("_")}  # wandb's _step, _runtime
                history.setdefault(record.history.step.num, {}).update(items)
    return history


@pytest.mark.slow  # wandb starts its own service process
def test_wandb_reporter_offline_logs_the_rows_at_their_steps(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is optional (report_to wandb needs it installed)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rows = [{"step": 1, "loss": 11.25, "grad_norm": 1.5, "num_tokens": 256},
            {"step": 2, "loss": 10.75, "grad_norm": 1.25, "num_tokens": 512}, {"step": 2, "eval_loss": 10.5}]
    rep = Reporters(["wandb"], str(tmp_path), {"learning_rate": 1e-3})
    for row in rows:
        rep.log(row)
    rep.close()
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    assert read_wandb_history(run_file) == {
        1: {"train/loss": 11.25, "train/grad_norm": 1.5, "train/num_tokens": 256},
        2: {"train/loss": 10.75, "train/grad_norm": 1.25, "train/num_tokens": 512, "eval/loss": 10.5}}


@pytest.mark.slow  # wandb starts its own service process
def test_wandb_without_a_login_is_a_config_error_naming_offline_mode(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is optional (report_to wandb needs it installed)")
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    rep = Reporters(["wandb"], str(tmp_path / "out"), {})
    with pytest.raises(ConfigError, match=r"^report_to wandb: .*WANDB_MODE=offline"):
        rep.open()
