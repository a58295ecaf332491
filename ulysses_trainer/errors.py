"""Errors that the command line turns into exit codes: 2 invalid input, 1 any other failure, 0 success."""


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
