"""The coverage account in words, for the sinks a person reads (human, HTML): what the master holds,
what was audited, and for each gap what it was and how to cover it."""

from __future__ import annotations

from audit.report.inert import printable


def _number(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


def coverage_headline(coverage: dict) -> str:
    others = any(t["audited"] and t["keys_named"] is not None for t in coverage["tenants"] or [])
    named = f", {coverage['keys_named']:,} named in other tenants" if others else ""
    return (f"coverage: the master holds {_number(coverage['keys_held'])} key(s); {coverage['keys_listed']:,} "
            f"listed{named}; {coverage['keys_read']:,} read")


def gap_lines(coverage: dict) -> list[str]:
    """Two lines per gap, what and how: blocking ones first ("not audited"), then what was left out."""
    lines = []
    for gap in sorted(coverage["not_audited"], key=lambda gap: not gap["blocking"]):
        lines.append(printable(f"{'not audited' if gap['blocking'] else 'left out'}: {gap['says']}", 400))
        lines.append(printable(f"  {'to cover' if gap['blocking'] else 'to include'}: {gap['how']}", 400))
    return lines


def missed_keys(coverage: dict) -> int | None:
    """Keys the master holds that the run should have audited and did not (None: not countable)."""
    counts = [gap["keys"] for gap in coverage["not_audited"] if gap["blocking"]]
    return None if None in counts else sum(counts)


def current_copy_place(current: dict) -> str:
    """Where a latent copy's key's current copy lies: its file here, or the holder the master lists
    it on, whose directory was not among those read (the key put again on another host)."""
    return current["file"] if "file" in current else f"on holder {current['endpoint']}, not in these directories"
