"""One argv splitter for the commands that take their own options beside training-config overrides."""

from __future__ import annotations


def option_name(arg: str) -> str | None:
    """`--gpus_per_node=8` and `--gpus-per-node 8` -> "gpus_per_node"; None for a non-option."""
    return arg[2:].split("=", 1)[0].replace("-", "_") if arg.startswith("--") else None


def split_argv(argv: list[str], own: set[str], flags: set[str]) -> tuple[list[str], list[str]]:
    """(this command's options, training-config overrides `--name value`): an option named in `own` (and
    anything that is not an option) is the command's; `flags` take no value; any other option takes the
    next argument as its value unless it is written `--name=value` or the next argument is an option."""
    ours, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        name = option_name(arg)
        bucket = ours if (name in own or name is None) else rest
        bucket.append(arg)
        if name not in flags and "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            bucket.append(argv[i + 1])
            i += 1
        i += 1
    return ours, rest
