"""Forensics: what a flagged key held (`evidence`: its bytes, saved during the scan), what every
key held at one time (`snapshot`: digests and verdicts in SQLite), and what changed between two
such times, or between one and the live cluster (`diff`)."""
