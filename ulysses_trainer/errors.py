"""Errors that the command line turns into exit codes: 2 invalid input, 1 any other failure, 0 success; and the
near-typo lookup their messages name the likely key with."""

import difflib


class ConfigError(ValueError):
    """Invalid input: reported before any heavy work, exit code 2. The message names the fix."""


class PlanMismatchError(RuntimeError):
    """The ranks resolved different plans: a run-time failure (exit 1) found before step 1, never a hang."""


class JobStartError(RuntimeError):
    """The process group could not start (e.g. its port is another job's): a run-time failure, exit 1."""


EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_INVALID = 2
EXIT_INTERRUPTED = 130  # the shell's code for a process ended by Ctrl-C (128 + SIGINT)


def close_name(name: str, names: list[str]) -> str | None:
    """The one of `names` that `name` is a near typo of, or None. 0.8: a typo (learning_rat,
    gradient_acumulation_steps), not a different name sharing a suffix (dataset_config / peft_config scores 0.72)."""
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.8)
    return close[0] if close else None
