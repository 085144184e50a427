"""Errors that mean "the input is wrong" (exit code 2) as opposed to "the job failed" (exit code 1)."""


class UserError(Exception):
    """Bad usage or bad input: a config key, a file, a record. The message is one line and names it."""


class JobFailed(RuntimeError):
    """The job failed for a reason its one-line message names and says what to do about (exit code 1).
    The command prints that line alone: a traceback into the training loop adds nothing to it."""
