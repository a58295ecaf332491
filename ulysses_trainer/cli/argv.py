"""The one argv splitter: `walk` reads a command line once into options (`--name value`, `--name=value`, a bare
`--name`) and other arguments; every command splits and parses through it. `split_argv` parts a command's own
options from training-config overrides (plan, rehearse, data, the train launcher), `split_overrides` parts
`[--config RECIPE] [--name value ...]` into the recipe path and the options as written, `load_config` hands
both to config.load.config_from, which reads them in one pass (the rank entry, data, rehearse); `parse_overrides`
gives the typed overrides alone (plan). A command suggested to the user (`plan_command`) is built from the same
walk, so what it keeps is what the commands read back."""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from ..config import TrainConfig
from ..config.load import command_line_values, config_from
from ..errors import ConfigError


def option_name(arg: str) -> str | None:
    """`--gpus_per_node=8` and `--gpus-per-node 8` -> "gpus_per_node"; None for a non-option."""
    return arg[2:].split("=", 1)[0].replace("-", "_") if arg.startswith("--") else None


@dataclass(frozen=True)
class Arg:
    """One option with its value (None: written bare), or one other argument (name None, value the argument);
    `args`: the command-line arguments it took, as written."""

    name: str | None
    value: str | None
    args: tuple[str, ...]


def walk(argv: list[str], flags: set[str] | frozenset[str] = frozenset()) -> list[Arg]:
    """argv as options and other arguments: an option not in `flags` takes the next argument as its value unless
    it is written `--name=value` or the next argument is an option (`--...`)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        name = option_name(arg)
        if name is None:
            out.append(Arg(None, arg, (arg,)))
        elif "=" in arg:
            out.append(Arg(name, arg.split("=", 1)[1], (arg,)))
        elif name not in flags and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out.append(Arg(name, argv[i + 1], (arg, argv[i + 1])))
            i += 1
        else:
            out.append(Arg(name, None, (arg,)))
        i += 1
    return out


def split_argv(argv: list[str], own: set[str], flags: set[str],
               others: Literal["own", "rest"] = "own") -> tuple[list[str], list[str]]:
    """(this command's options, the rest: training-config overrides `--name value`), each in the order written:
    an option named in `own` is the command's, as is any non-option argument unless `others` is "rest"; `flags`
    take no value."""
    ours: list[str] = []
    rest: list[str] = []
    for a in walk(argv, flags):
        mine = a.name in own if a.name is not None else others == "own"
        (ours if mine else rest).extend(a.args)
    return ours, rest


def split_overrides(argv: list[str]) -> tuple[str | None, list[tuple[str, str | None]]]:
    """(recipe path, [(name, text or None when written bare)]) from `[--config R] [--name value | --name=value]`,
    in the order written: split only; config.load.command_line_values reads the options."""
    recipe: str | None = None
    options: list[tuple[str, str | None]] = []
    for a in walk(list(argv)):
        if not a.name:  # a non-option, or "--" alone
            raise ConfigError(f"unexpected argument {a.args[0]!r}; arguments are `--name value` pairs")
        if a.name != "config":
            options.append((a.name, a.value))
        elif a.value is None:
            raise ConfigError("--config needs a value: `--config VALUE`")
        else:
            recipe = a.value
    return recipe, options


def parse_overrides(argv: list[str]) -> tuple[str | None, dict[str, Any]]:
    """(recipe path, {name: value read as YAML}) from `[--config R] [--name value | --name=value ...]`; a bare
    `--name` is true for a field that takes true (`--packing`); --local_rank (the launcher's) is dropped."""
    recipe, options = split_overrides(argv)
    return recipe, command_line_values(options)


def load_config(argv: list[str]) -> TrainConfig:
    """The TrainConfig of `[--config RECIPE.yaml] [--name value ...]` (each value read as YAML; the command line
    overrides the recipe, the recipe the defaults). Bad input is a ConfigError naming the fix."""
    recipe, options = split_overrides(argv)
    return config_from(recipe, command_line=options)


def plan_command(argv: list[str], pinned: Iterable[str], world_size: int) -> str:
    """`ulysses-trainer plan` with the user's training arguments minus the pinned levers' options (each with the
    value walk gave it, so a bare `--gradient_checkpointing` takes nothing after it); a lever pinned by the recipe
    instead is set back to its default (auto; gradient_checkpointing true) on the command line."""
    pinned = tuple(pinned)
    drop = {*pinned, "local_rank"}
    kept: list[str] = []
    given: set[str] = set()
    for a in walk(list(argv)):
        if a.name in drop:
            given.add(a.name)
        else:
            kept.extend(a.args)
    # pinned in a recipe (not on the command line): set back explicitly, or the recipe would pin it again
    reset = [x for n in pinned if n not in given
             for x in (f"--{n}", "true" if n == "gradient_checkpointing" else "auto")]
    return shlex.join(["ulysses-trainer", "plan", "--gpus", str(world_size), *kept, *reset])
