"""A TrainConfig from what a user writes: the defaults < a YAML recipe < `--name value` on the command line, each
value type-checked against its field; and from the dict a checkpoint saved (resume). Every problem is a
ConfigError (exit 2) whose message names the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from ..zero_json import DEEPSPEED_TOP_LEVEL, FILLED_FROM
from .name_hints import TRL_NAMES, refusal, suggest
from .train_config import FIELDS, HINTS, PACKAGE_DIR, TrainConfig, record_origins
from .typed_values import NO_MATCH, coerce, describe, literal_choices
from .yaml_numbers import load_yaml

# Launcher arguments that are accepted and dropped (deepspeed adds --local_rank).
IGNORED = {"local_rank"}
# The fields a bare `--name` sets true (`--packing`): those whose type takes true.
TAKES_TRUE = frozenset(n for n, tp in HINTS.items() if coerce(True, tp) is True)


# ---------------------------------------------------------------- types
def _check_value(name: str, value: Any, where: str) -> Any:
    tp = HINTS[name]
    out = coerce(value, tp)
    if out is NO_MATCH:
        msg = f"{name} must be {describe(tp)}, got {value!r} ({where})"
        choices = literal_choices(tp)
        close = difflib.get_close_matches(value, choices, 1, 0.4) if isinstance(value, str) else []
        if close:
            msg += f"; did you mean {close[0]!r}?"
        raise ConfigError(msg)
    return out


def unknown_name(name: str, where: str) -> ConfigError:
    reason = refusal(name)
    if reason is not None:  # a TRL option that does not apply here: its reason, never a look-alike's name
        return ConfigError(f"{name} ({where}) is a TRL option this trainer does not support: {reason}; remove it")
    if name in DEEPSPEED_TOP_LEVEL and name not in TRL_NAMES:  # a ZeRO JSON key given as a training setting
        filled = FILLED_FROM.get(name)
        fix = (f"the trainer fills it from {filled}: set that" if filled else
               "write it in the JSON that `deepspeed` names (ds_configs/zero3.json)")
        return ConfigError(f"unknown config name {name!r} ({where}): it is a key of the ZeRO (DeepSpeed) JSON, not a "
                           f"training setting; {fix}")
    return ConfigError(f"unknown config name {name!r} ({where}){suggest(name, list(FIELDS))}")


def _zero_json_as_recipe(recipe: dict[str, Any], path: str) -> ConfigError | None:
    """A ZeRO JSON passed where the recipe goes (`--config ds_configs/zero3.json`): say where it goes instead."""
    ours = [k for k in recipe if k in FIELDS]
    theirs = [k for k in recipe if k in DEEPSPEED_TOP_LEVEL and k not in FIELDS]
    if "zero_optimization" in recipe or (theirs and len(theirs) >= len(ours)):
        return ConfigError(f"{path} is a ZeRO (DeepSpeed) JSON, not a training recipe: pass it with --deepspeed "
                           f"{path} (or `deepspeed: {path}` in a recipe); --config takes a YAML recipe of training "
                           f"settings (launch/recipes/)")
    return None


# ---------------------------------------------------------------- loading
def yaml_error(exc: yaml.YAMLError, what: str) -> ConfigError:
    mark = getattr(exc, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc)
    return ConfigError(f"{what} is not valid YAML{at}: {problem}; fix the syntax there")


def resolve_recipe(path: str) -> Path:
    """The recipe file: the path as given, else the package's copy of a shipped recipe named by its file
    (`launch/recipes/NAME.yaml`, `NAME.yaml` or `NAME`): the same file in a checkout and in an installed package."""
    p = Path(path)
    if p.is_file() or p.is_absolute():
        return p
    name = p.name if p.suffix in (".yaml", ".yml") else p.name + ".yaml"
    shipped = PACKAGE_DIR / "recipes" / name
    return shipped if shipped.is_file() else p


def shipped_recipes() -> list[str]:
    return sorted(f.stem for f in (PACKAGE_DIR / "recipes").glob("*.yaml"))


def read_recipe(path: str) -> dict[str, Any]:
    """The mapping of a YAML recipe (unvalidated)."""
    p = resolve_recipe(path)
    if not p.is_file():
        raise ConfigError(f"recipe {path!r} not found; pass an existing YAML file to --config, or a shipped "
                          f"recipe by name ({', '.join(shipped_recipes())}; the checkout's launch/recipes/)")
    try:
        data = load_yaml(p.read_text())
    except yaml.YAMLError as exc:
        raise yaml_error(exc, f"recipe {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read recipe {path}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {path} must be a mapping of `name: value` lines, "
                          f"got {type(data).__name__}")
    wrong = _zero_json_as_recipe(data, path)
    if wrong is not None:
        raise wrong
    return data


def build_config(recipe: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
                 recipe_name: str = "recipe") -> TrainConfig:
    """Defaults, then the recipe, then the overrides, each value type-checked."""
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}  # where each value given came from (TrainConfig.origin, for messages)
    for source, where, origin in ((recipe or {}, f"in {recipe_name}", recipe_name),
                                  (overrides or {}, "on the command line", "the command line")):
        for name, value in source.items():
            if name in IGNORED:
                continue
            if name not in FIELDS:
                raise unknown_name(name, where)
            values[name] = _check_value(name, value, where)
            origins[name] = origin
    cfg = TrainConfig(**values)
    record_origins(cfg, origins)
    return cfg


def command_line_values(options: Iterable[tuple[str, str | None]]) -> dict[str, Any]:
    """{name: value read as YAML} of the command line's options `(name, text)` in the order written (cli/argv
    splits them); text None: written bare, true for a field that takes true (`--packing`); the launcher's
    --local_rank is dropped. The names are checked here, the values' types by build_config."""
    pairs: dict[str, Any] = {}
    for name, text in options:
        if name not in FIELDS and name not in IGNORED:
            raise unknown_name(name, "command line")
        if text is None:
            if name not in TAKES_TRUE:
                raise ConfigError(f"--{name} needs a value: `--{name} VALUE`")
            pairs[name] = True  # `--bf16` alone = true
        elif name not in IGNORED:
            try:
                pairs[name] = load_yaml(text)
            except yaml.YAMLError as exc:
                raise yaml_error(exc, f"the value of --{name} ({text!r})") from None
    return pairs


def config_from(recipe_path: str | None = None, overrides: dict[str, Any] | None = None,
                command_line: Iterable[tuple[str, str | None]] = ()) -> TrainConfig:
    """The recipe's values (a YAML file, when given) over the defaults, then `overrides` and the `command_line`
    options (command_line_values) over them: cli/argv.load_config splits `--config R --name value ...` into the
    recipe path and the options, and everything else is read here, in one pass."""
    values = {**(overrides or {}), **command_line_values(command_line)}
    recipe = read_recipe(recipe_path) if recipe_path else {}
    return build_config(recipe, values, recipe_name=f"recipe {recipe_path}")


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """Inverse of config_to_dict (for resume), with the same checks as a recipe."""
    return build_config(data, recipe_name="saved config")
