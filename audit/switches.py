"""On/off switches read from the environment: one set of words for every switch, and a value that is
none of them an error, never silently off (a guard an operator asked for must not vanish)."""

from __future__ import annotations

from collections.abc import Mapping

ON = ("1", "on", "true", "yes")
OFF = ("0", "off", "false", "no")


def switch(env: Mapping[str, str], name: str, *, default: bool) -> bool:
    """`env[name]` as on or off; unset or empty: `default`. A ValueError for any other word."""
    value = env.get(name, "").strip().lower()
    if not value:
        return default
    if value in ON:
        return True
    if value in OFF:
        return False
    raise ValueError(f"{name}={env[name]!r}: expected on or off (1 or 0)")
