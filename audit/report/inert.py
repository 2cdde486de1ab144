"""Untrusted text (key names) made inert for a terminal: no escape sequence, no rich markup."""

from __future__ import annotations

from rich.text import Text

MAX_SHOWN = 160


def printable(text: str, limit: int = MAX_SHOWN) -> str:
    """Control and non-printable characters as visible escapes (\\n, \\x1b); long names cut."""
    shown = "".join(ch if ch.isprintable() else ch.encode("unicode_escape", "backslashreplace").decode("ascii")
                    for ch in text[:limit])
    if len(text) > limit:
        shown += f"… ({len(text)} chars)"
    return shown


def inert(text: str, limit: int = MAX_SHOWN) -> Text:
    """A rich Text, never parsed as markup."""
    return Text(printable(text, limit))
