"""`ulysses-trainer SUBCOMMAND ...` (also `python -m ulysses_trainer SUBCOMMAND ...`).

Subcommands register in SUBCOMMANDS as "name": ("module", "one-line help"); each module has
main(argv) -> exit code. Training is `deepspeed launch/train.py` or `ulysses-trainer train`.
"""

from __future__ import annotations

import importlib
import sys

from .errors import EXIT_INTERRUPTED, EXIT_INVALID, EXIT_OK

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "data": ("ulysses_trainer.cli.data", "the training sequences as the trainer builds them, trained spans marked, "
                                        "and their counts (no GPU)"),
    "train": ("ulysses_trainer.cli.launcher", "`deepspeed` on one node in its own session: Ctrl-C saves and waits "
                                              "for the ranks; a second Ctrl-C stops at once"),
    "plan": ("ulysses_trainer.cli.plan", "predict per-GPU and host memory; choose settings that fit "
                                        "(`plan calibrate`: predicted vs measured)"),
    "rehearse": ("ulysses_trainer.cli.rehearse", "run one rank of an N-GPU job on one device (fake process "
                                                 "group): its memory and compute, plus modelled communication"),
}


def _usage() -> str:
    lines = ["usage: ulysses-trainer SUBCOMMAND [options]   (SUBCOMMAND --help for its options)", ""]
    lines += [f"  {name:<10} {helptext}" for name, (_, helptext) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return EXIT_OK if argv else EXIT_INVALID
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"error: unknown subcommand {name!r}; use one of: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return EXIT_INVALID
    try:
        module = importlib.import_module(SUBCOMMANDS[name][0])
        return module.main(rest)
    except KeyboardInterrupt:  # Ctrl-C while torch imports or before a subcommand handles signals itself
        what = "interrupted before training: nothing written" if name == "train" else "interrupted"
        print(f"[ulysses_trainer] {what}", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
