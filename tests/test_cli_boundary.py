"""The library/command boundary: one argv walk that every command splits through; the library never prints, exits
or reads the launcher's environment; its messages reach the console as `[ulysses_trainer] ...` lines."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from ulysses_trainer.cli import data as data_cli
from ulysses_trainer.cli import launcher
from ulysses_trainer.cli.argv import Arg, load_config, parse_overrides, split_argv, split_overrides, walk
from ulysses_trainer.cli.console import use_console
from ulysses_trainer.config import TrainConfig
from ulysses_trainer.config.load import config_from
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.messages import ON_STDERR

PKG = Path(__file__).resolve().parent.parent / "ulysses_trainer"


def _library_files():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] != "cli" and rel.name != "__main__.py":
            yield rel, ast.parse(path.read_text())


# ---------------------------------------------------------------- one walk
def test_walk_reads_each_spelling_of_an_option_once():
    assert walk(["--a", "1", "--b=2", "--c", "--d", "x", "pos", "--json", "v"], flags={"json"}) == [
        Arg("a", "1", ("--a", "1")), Arg("b", "2", ("--b=2",)), Arg("c", None, ("--c",)),
        Arg("d", "x", ("--d", "x")), Arg(None, "pos", ("pos",)), Arg("json", None, ("--json",)),
        Arg(None, "v", ("v",))]
    assert walk(["--gpus-per-node", "8"])[0].name == "gpus_per_node"


def test_the_train_launcher_hands_the_runner_its_options_and_the_ranks_the_rest():
    argv = ["--num_gpus", "2", "--config", "r.yaml", "--master_port=1234", "--max_steps", "3", "--packing",
            "--hostfile", "h", "stray"]
    assert launcher._split(argv) == (["--num_gpus", "2", "--master_port=1234", "--hostfile", "h"],
                                     ["--config", "r.yaml", "--max_steps", "3", "--packing", "stray"])


def test_the_commands_own_options_and_the_overrides_split_in_order():
    ours, rest = split_argv(["--config", "r.yaml", "--gpus", "8", "--tiled_mlp", "4", "--json", "--bf16", "false"],
                            own={"config", "gpus", "json"}, flags={"json"})
    assert ours == ["--config", "r.yaml", "--gpus", "8", "--json"]
    assert rest == ["--tiled_mlp", "4", "--bf16", "false"]
    assert data_cli._split(["--show", "2", "--json", "--max_length", "64"]) == (True, 2, ["--max_length", "64"])
    assert data_cli._split(["--show=5"]) == (False, 5, [])
    with pytest.raises(ConfigError, match="--show needs a number of sequences, got 'x'"):
        data_cli._split(["--show", "x"])
    with pytest.raises(ConfigError, match="unexpected argument 'stray'"):
        data_cli._split(["stray"])


def test_the_overrides_parse_as_the_trainer_reads_them(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("max_length: 128\nlearning_rate: 2.0e-5\n")
    assert parse_overrides(["--config", str(recipe), "--packing", "--local_rank=3", "--bf16=false",
                            "--max-steps", "7"]) == (str(recipe), {"packing": True, "bf16": False, "max_steps": 7})
    cfg = load_config(["--config", str(recipe), "--max_steps", "7"])
    assert cfg == config_from(str(recipe), {"max_steps": 7})
    assert (cfg.max_length, cfg.learning_rate, cfg.max_steps) == (128, 2e-5, 7)
    assert config_from() == TrainConfig()
    for argv, message in ((["--", "x"], "unexpected argument '--'"), (["x"], "unexpected argument 'x'"),
                          (["--max_length"], "--max_length needs a value"),
                          (["--max_lenght", "1"], "unknown config name 'max_lenght'")):
        with pytest.raises(ConfigError, match=message):
            parse_overrides(argv)


def test_the_command_line_is_read_in_one_pass_by_the_config(tmp_path):
    """load_config only splits; config.load.config_from reads the options as written: the same config as the typed
    overrides, and the command line's names are checked before the recipe is read, as before."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("max_length: 128\n")
    argv = ["--config", str(recipe), "--packing", "--local_rank=3", "--lr_scheduler_type", "cosine"]
    assert split_overrides(argv) == (str(recipe), [("packing", None), ("local_rank", "3"),
                                                   ("lr_scheduler_type", "cosine")])
    assert load_config(argv) == config_from(str(recipe), parse_overrides(argv)[1])
    assert config_from(None, command_line=[("packing", None)]).packing is True
    with pytest.raises(ConfigError, match="unknown config name 'pakcing' \\(command line\\)"):
        load_config(["--config", str(tmp_path / "missing.yaml"), "--pakcing"])
    with pytest.raises(ConfigError, match="recipe .*missing.yaml.* not found"):
        load_config(["--config", str(tmp_path / "missing.yaml"), "--packing"])
    for bad, message in (("config", "--config needs a value"), ("local_rank", "--local_rank needs a value")):
        with pytest.raises(ConfigError, match=message):
            load_config([f"--{bad}"])


# ---------------------------------------------------------------- the library acts as no command
def test_the_library_never_prints_exits_or_reads_rank():
    found = []
    for rel, tree in _library_files():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                found.append(f"{rel}:{node.lineno} print()")
            if isinstance(node, ast.Raise) and node.exc is not None and "SystemExit" in ast.unparse(node.exc):
                found.append(f"{rel}:{node.lineno} raise SystemExit")
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.exit", "exit", "quit"):
                found.append(f"{rel}:{node.lineno} exit")
            if isinstance(node, ast.Constant) and node.value == "--help":
                found.append(f"{rel}:{node.lineno} --help")
    assert not found, f"the commands (cli/) own output, exits and --help: {found}"


def test_load_config_leaves_help_to_the_command(monkeypatch, capsys):
    from ulysses_trainer.cli.train import main

    with pytest.raises(ConfigError, match="unexpected argument '-h'"):
        load_config(["-h"])
    monkeypatch.setenv("RANK", "0")
    assert main(["--help"]) == 0 and "--max_length (" in capsys.readouterr().out


def test_messages_reach_the_console_as_before(capsys):
    use_console()
    use_console()  # once per process, however often a command asks
    log = logging.getLogger("ulysses_trainer.train.run_report")
    log.info("plan: sp 2 x dp 1")
    log.warning("warning: the plan does not fit: x")
    log.info("interrupted: saving step 3", extra=ON_STDERR)
    log.debug("not shown")
    out, err = capsys.readouterr()
    assert out == "[ulysses_trainer] plan: sp 2 x dp 1\n[ulysses_trainer] warning: the plan does not fit: x\n"
    assert err == "[ulysses_trainer] interrupted: saving step 3\n"


def test_the_run_report_lines_are_unchanged(capsys):
    from ulysses_trainer.train import run_report

    run_report.report_run_name("night-1")
    run_report.say_stopping("steps")
    out, err = capsys.readouterr()
    assert out == "[ulysses_trainer] run night-1\n"
    assert err == ("[ulysses_trainer] interrupted: saving at the next step boundary (a second Ctrl-C stops at "
                   "once; the last checkpoint stays)\n")


def test_every_failure_kind_is_one_line_and_its_exit_code(monkeypatch, capsys):
    """cli/train._ended_by: a TrainerError of each kind is its one `error:` line and its own exit code, and the
    process group is ended only where no peer may sit inside a collective; out of GPU memory appends the plan
    command; a first Ctrl-C is 130, a second one 1 with why; an unnamed failure is its traceback and 1."""
    from types import SimpleNamespace

    from ulysses_trainer.cli import train
    from ulysses_trainer.errors import JobStartError, PlanMismatchError
    from ulysses_trainer.train.non_finite import NonFiniteError
    from ulysses_trainer.train.out_of_memory import OutOfGpuMemory
    from ulysses_trainer.train.output_guard import OutputWriteError
    from ulysses_trainer.train.stop_signal import InterruptRecorder
    from ulysses_trainer.train.verify_sp import VerifySpError

    ended = []
    monkeypatch.setattr(train, "_end_group", lambda: ended.append(True))
    monkeypatch.setattr(train, "_fitting_plan", lambda argv, pinned, world: f"plan for {pinned} on {world}")
    monkeypatch.setenv("RANK", "0")
    plan = SimpleNamespace(world_size=8, cfg=SimpleNamespace(output_dir="/nonexistent"))
    seen = InterruptRecorder()
    cases = [(ConfigError("bad"), 2, True), (VerifySpError("differs"), 2, True), (PlanMismatchError("p"), 1, True),
             (JobStartError("port"), 1, False), (NonFiniteError("nan"), 1, True), (OutputWriteError("disk"), 1, True),
             (OutOfGpuMemory("oom", ("tiled_mlp",)), 1, False)]
    for exc, code, ends in cases:
        ended.clear()
        assert train._ended_by(exc, seen, [], plan) == code, exc
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {exc}"), err
        assert bool(ended) == ends, exc
    train._ended_by(OutOfGpuMemory("oom", ("tiled_mlp",)), seen, [], plan)
    assert capsys.readouterr().err.strip() == "error: oom; plan for ('tiled_mlp',) on 8"
    assert train._ended_by(KeyboardInterrupt(), seen, [], plan) == 130
    assert train._ended_by(KeyboardInterrupt("a second Ctrl-C"), seen, [], plan) == 1
    assert "interrupted: a second Ctrl-C" in capsys.readouterr().err
    try:
        raise RuntimeError("unnamed")
    except RuntimeError as exc:
        assert train._ended_by(exc, seen, [], None) == 1
    assert capsys.readouterr().err.startswith("Traceback")
