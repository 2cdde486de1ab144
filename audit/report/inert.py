"""Untrusted text (key names) made inert for a terminal: no escape sequence, no rich markup;
keys shortened for one line of a table; and the byte counts printed beside them."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.text import Text

MAX_SHOWN = 160
HASH_HEAD, HASH_TAIL = 8, 6  # hex digits of a long hash a table keeps (56 bits: two keys alike in 10^16)
HASH_ELIDED_FROM = 24        # shorter hex runs (a 64-bit hash, a number) stay whole
_LONG_HASH = re.compile(r"(?<![0-9A-Za-z])([0-9a-fA-F]{%d})[0-9a-fA-F]{%d,}([0-9a-fA-F]{%d})(?![0-9A-Za-z])"
                        % (HASH_HEAD, HASH_ELIDED_FROM - HASH_HEAD - HASH_TAIL, HASH_TAIL))


def printable(text: str, limit: int = MAX_SHOWN) -> str:
    """Control and non-printable characters as visible escapes (\\n, \\x1b); long names cut."""
    shown = "".join(ch if ch.isprintable() else ch.encode("unicode_escape", "backslashreplace").decode("ascii")
                    for ch in text[:limit])
    if len(text) > limit:
        shown += f"… ({len(text)} chars)"
    return shown


def short_key(key: str, limit: int = MAX_SHOWN) -> str:
    """A key for one line of a human table: the middle of every long hex run elided
    (``...@group:2@3f9a1c2e…9d0b1f``, vLLM's chunk hash, LMCache's and SGLang's page hashes), then
    made printable. JSON, HTML titles and `explain` keep keys whole."""
    return printable(_LONG_HASH.sub(r"\1…\2", key), limit)


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
    """A rich Text, never parsed as markup (rich imported on first use: a scan that prints no table
    pays none of it)."""
    from rich.text import Text

    return Text(printable(text, limit))


def inert_key(key: str) -> Text:
    """A table's key cell: `short_key`, never parsed as markup."""
    from rich.text import Text

    return Text(short_key(key))
