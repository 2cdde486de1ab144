"""The one exception the CLI turns into a one-line message and exit code 2 ("could not run"), and
the error codes a read can end in: Mooncake's, and the auditor's own."""


class AuditError(RuntimeError):
    """A reason the audit cannot run, worded for the operator (one line, no traceback)."""


# Mooncake error codes the audit meets (mooncake-store/include/types.h).
ERROR_NAMES = {
    -600: "BUFFER_OVERFLOW",
    -704: "OBJECT_NOT_FOUND",
    -706: "OBJECT_HAS_LEASE",
    -800: "TRANSFER_FAIL",
    -801: "CHECKSUM_MISMATCH",
    # The auditor's own codes, never Mooncake's: outcomes of a lease-free read (audit.readers).
    -9001: "MOVED",
    -9002: "NOT_PEEKABLE",
    -9003: "TASK_LOST",
}
MOVED = -9001         # a replica's descriptor changed while it was read raw: the bytes may be another value's
NOT_PEEKABLE = -9002  # no memory replica to read lease-free (a key holding a comma, or disk-only replicas)
TASK_LOST = -9003     # the Ray task reading the key died, and so did its retry
