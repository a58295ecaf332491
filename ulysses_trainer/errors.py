"""The one exception type the command line turns into an exit code (TrainerError: 2 invalid input, 1 any other
failure; 0 success, 130 Ctrl-C), its kinds raised across the package, and the near-typo lookup their messages name
the likely key with."""

import difflib

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_INVALID = 2
EXIT_INTERRUPTED = 130  # the shell's code for a process ended by Ctrl-C (128 + SIGINT)


class TrainerError(Exception):
    """Every failure the command line reports as one `error:` line, with its exit code. `end_group`: whether the
    process group may still be ended (False where a peer may sit inside a collective or no group was started)."""

    exit_code = EXIT_FAILURE
    end_group = True


class ConfigError(TrainerError, ValueError):
    """Invalid input: reported before any heavy work, exit code 2. The message names the fix."""

    exit_code = EXIT_INVALID


class PlanMismatchError(TrainerError, RuntimeError):
    """The ranks resolved different plans: a run-time failure (exit 1) found before step 1, never a hang."""


class JobStartError(TrainerError, RuntimeError):
    """The process group could not start (e.g. its port is another job's): a run-time failure, exit 1."""

    end_group = False  # none was started


def close_name(name: str, names: list[str]) -> str | None:
    """The one of `names` that `name` is a near typo of, or None. 0.8: a typo (learning_rat,
    gradient_acumulation_steps), not a different name sharing a suffix (dataset_config / peft_config scores 0.72)."""
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.8)
    return close[0] if close else None
