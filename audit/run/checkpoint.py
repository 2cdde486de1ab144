"""`--checkpoint PATH` / `--resume`: a full scan that survives Ctrl-C, a crash or a reboot.

The checkpoint is JSON Lines: a header naming what is being scanned, then one line per checked
key, flushed and fsynced after every batch. `--resume` reads it back, skips every key already
audited (keys that could not be read are tried again) and merges the old records with the new.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from audit.errors import AuditError
from audit.records import KeyRecord

SCHEMA = "mooncake-audit/checkpoint"


class Checkpoint:
    def __init__(self, path: Path, scope: dict, resume: bool):
        self.path = Path(path)
        self.done: dict[str, KeyRecord] = self._load(scope) if resume and self.path.exists() else {}
        try:
            self._file = open(self.path, "w", encoding="utf-8")
        except OSError as error:
            raise AuditError(f"cannot write checkpoint {self.path}: {error.strerror}") from None
        self._write({"type": "header", "schema": SCHEMA, "version": 1, "scope": scope})
        for record in self.done.values():
            self._write({"type": "key", **record.to_json()})
        self._sync()

    def _load(self, scope: dict) -> dict[str, KeyRecord]:
        done: dict[str, KeyRecord] = {}
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
            header = json.loads(lines[0]) if lines else {}
            if header.get("schema") != SCHEMA:
                raise AuditError(f"{self.path} is not a mooncake-audit checkpoint")
            if header.get("scope") != scope:
                raise AuditError(f"checkpoint {self.path} belongs to another scan ({header.get('scope')}); "
                                 f"remove it or drop --resume")
            for line in lines[1:]:
                try:
                    document = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line cut by a crash: everything before it is good
                record = KeyRecord.from_json(document)
                if not record.is_incomplete:
                    done[record.key] = record
        except (OSError, UnicodeDecodeError, KeyError, ValueError) as error:
            if isinstance(error, AuditError):
                raise
            raise AuditError(f"cannot resume from checkpoint {self.path}: {error}") from None
        return done

    def _write(self, document: dict) -> None:
        self._file.write(json.dumps(document) + "\n")

    def _sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def append(self, records: list[KeyRecord]) -> None:
        for record in records:
            self._write({"type": "key", **record.to_json()})
        self._sync()

    def close(self) -> None:
        self._file.close()
