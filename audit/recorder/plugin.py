"""The vLLM general plugin: install the recording store when the environment asks for it.

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes before the connector
builds its store, and the connector looks ``MooncakeDistributedStore`` up in ``mooncake.store`` only
then; replacing that attribute is enough. Without ``MOONCAKE_AUDIT_RECORD`` or
``MOONCAKE_AUDIT_GUARD`` or ``MOONCAKE_AUDIT_LOAD_GUARD`` this module does nothing and imports
nothing else.

Environment:
  MOONCAKE_AUDIT_RECORD=DIR         record every published key's block ids, every loaded key's
                                    request, and per chunk hash the digest of the tokens its state
                                    holds at layer 0 (`audit.recorder.prefixes`), into DIR
  MOONCAKE_AUDIT_GUARD=1            withhold keys read from the null block (implies recording; into
                                    MOONCAKE_AUDIT_RECORD if set, else default_record_directory())
  MOONCAKE_AUDIT_LOAD_GUARD=1       check every loaded value before the model reads it and fail the
                                    request of a bad one into vLLM's own path (implies recording)
  MOONCAKE_AUDIT_LOAD_GUARD_RECORDS=DIR[:DIR...]
                                    producers' record directories whose null-backed keys the load
                                    guard refuses outright (its own directory always counts)
  MOONCAKE_AUDIT_RECORD_MAX_MB=64   start a new file when one would grow past this size
  MOONCAKE_AUDIT_RECORD_KEEP=0      newest files kept per process and kind (0: keep all)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from audit.switches import switch

RECORD_ENV = "MOONCAKE_AUDIT_RECORD"
GUARD_ENV = "MOONCAKE_AUDIT_GUARD"
LOAD_GUARD_ENV = "MOONCAKE_AUDIT_LOAD_GUARD"
LOAD_GUARD_RECORDS_ENV = "MOONCAKE_AUDIT_LOAD_GUARD_RECORDS"
MAX_MB_ENV = "MOONCAKE_AUDIT_RECORD_MAX_MB"
KEEP_ENV = "MOONCAKE_AUDIT_RECORD_KEEP"

logger = logging.getLogger("vllm.mooncake_audit")  # under "vllm" so vLLM's log configuration prints it


@dataclass(frozen=True)
class RecorderSettings:
    directory: Path
    guard: bool
    max_bytes: int
    keep_files: int
    load_guard: bool = False
    put_records: tuple[Path, ...] = ()  # other directories whose null-backed keys the load guard refuses

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RecorderSettings | None:
        """The settings the environment asks for, or None when it asks for nothing.

        A malformed value is a ValueError: a guard asked for must not be silently off.
        """
        record = env.get(RECORD_ENV, "").strip()
        guard = switch(env, GUARD_ENV, default=False)
        load_guard = switch(env, LOAD_GUARD_ENV, default=False)
        if not record and not guard and not load_guard:
            return None
        put_records = tuple(Path(part) for part in env.get(LOAD_GUARD_RECORDS_ENV, "").split(":") if part.strip())
        return cls(directory=Path(record) if record else default_record_directory(env), guard=guard,
                   max_bytes=_count(env, MAX_MB_ENV, 64, minimum=1) << 20,
                   keep_files=_count(env, KEEP_ENV, 0, minimum=0), load_guard=load_guard, put_records=put_records)


def default_record_directory(env: Mapping[str, str]) -> Path:
    """Where the guard records when no directory is given: $XDG_STATE_HOME/mooncake-audit/records."""
    state = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "mooncake-audit" / "records"


def _count(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    value = env.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < minimum:
        raise ValueError(f"{name}={value!r}: expected an integer >= {minimum}")
    return int(value)


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (may run several times per process)."""
    settings = RecorderSettings.from_env(os.environ)
    if settings is not None:
        install(settings)


def install(settings: RecorderSettings) -> type | None:
    """Replace ``mooncake.store.MooncakeDistributedStore`` by its recording subclass, once.

    Returns the class in place afterwards, or None where Mooncake is not importable (a process that
    cannot publish has nothing to record).
    """
    try:
        import mooncake.store as mooncake_store
    except ImportError as error:
        logger.warning("mooncake-audit recorder not installed: mooncake.store is not importable (%s)", error)
        return None
    current = mooncake_store.MooncakeDistributedStore
    if getattr(current, "audit_writer", None) is not None:
        return current
    from audit.recorder.records import RecordWriter
    from audit.recorder.wrapper import recording_store_class

    def writer(stem: str) -> RecordWriter:
        return RecordWriter(settings.directory, settings.max_bytes, settings.keep_files, stem=stem)

    load_guard = None
    if settings.load_guard:
        from audit.recorder.binding import StateBinder
        from audit.recorder.deny import DENIED_STEM, DenyList
        from audit.recorder.guard import LoadGuard

        deny = writer(DENIED_STEM)

        def load_guard() -> LoadGuard:  # one per store: each holds its own consumer's regions
            return LoadGuard(DenyList(settings.directory, deny, list(settings.put_records)),
                             StateBinder(settings.directory))

    mooncake_store.MooncakeDistributedStore = recording_store_class(
        current, writer("blocks"), guard=settings.guard, loads=writer("loads"), load_guard=load_guard)
    from audit.prefixrecords import PREFIX_RECORD_PREFIX
    from audit.recorder.prefixes import install_prefix_recorder

    install_prefix_recorder(writer(PREFIX_RECORD_PREFIX.rstrip("-")))
    logger.info("mooncake-audit recorder installed: put and load records in %s, null-block guard %s, load guard %s",
                settings.directory, "on" if settings.guard else "off", "on" if settings.load_guard else "off")
    return mooncake_store.MooncakeDistributedStore
