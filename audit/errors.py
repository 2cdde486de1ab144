"""The one exception the CLI turns into a one-line message and exit code 2 ("could not run")."""


class AuditError(RuntimeError):
    """A reason the audit cannot run, worded for the operator (one line, no traceback)."""
