"""Errors that mean "the input is wrong" (exit code 2) as opposed to "the job failed" (exit code 1)."""


class UserError(Exception):
    """Bad usage or bad input: a config key, a file, a record. The message is one line and names it."""
