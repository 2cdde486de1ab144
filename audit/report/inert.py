"""Untrusted text (key names) made inert for a terminal: no escape sequence, no rich markup;
and the byte counts printed beside them."""

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


def human_bytes(n: float | None) -> str:
    """1536 -> '1.5 KiB' (binary units, as `ls -h` and rich show them)."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def inert(text: str, limit: int = MAX_SHOWN) -> Text:
    """A rich Text, never parsed as markup."""
    return Text(printable(text, limit))
