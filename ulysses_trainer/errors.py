"""Errors that the command line turns into exit codes (CONTRACT.md)."""


class ConfigError(ValueError):
    """Invalid input: reported before any heavy work, exit code 2. The message names the fix."""


EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_INVALID = 2
