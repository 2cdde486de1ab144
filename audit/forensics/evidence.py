"""`--evidence DIR`: the bytes of every flagged key, kept before anything else can happen to it.

Values are saved while they are still in the read buffer, as gzip blobs named by content
(`blobs/<xxh3>-<size>.gz`: identical values are stored once), each key with a JSON sidecar
(`keys/<xxh3 of the key name>.json`, holding the exact name, verdicts, digests, replica
descriptors and the time). Keys that turn out to share content are saved when the second copy is
read, since the bytes are the same. The directory is created 0700: values may be private data.
"""

from __future__ import annotations

import gzip
import json
import os
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import xxhash

from audit.errors import AuditError
from audit.records import KeyInfo, KeyRecord, Report


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def key_file_name(key: str) -> str:
    """Key names are untrusted (slashes, newlines, 4 KiB): files are named by their digest."""
    return f"{xxhash.xxh3_64_hexdigest(key.encode('utf-8', 'surrogateescape'))}.json"


def write_atomically(path: Path, data: bytes) -> None:
    """Through a temporary dot-name (no holder scans it, no reader takes it for the file), then renamed."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with open(temp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, path)


class EvidenceStore:
    def __init__(self, directory: Path):
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(self.directory, 0o700)
            (self.directory / "blobs").mkdir(exist_ok=True, mode=0o700)
            (self.directory / "keys").mkdir(exist_ok=True, mode=0o700)
        except OSError as error:
            raise AuditError(f"cannot create evidence dir {self.directory}: {error.strerror}") from None
        self._first_of_content: dict[tuple[int, int], tuple[KeyInfo, KeyRecord]] = {}
        self.saved: set[str] = set()

    def save(self, info: KeyInfo, record: KeyRecord, data: np.ndarray, reason: str) -> Path:
        """Blob (once per content) and sidecar of one key; returns the sidecar's path."""
        blob = self.directory / "blobs" / f"{record.xxh3:016x}-{record.size}.gz"
        if not blob.exists():
            write_atomically(blob, gzip.compress(np.ascontiguousarray(data).tobytes(), compresslevel=1))
        sidecar = self.directory / "keys" / key_file_name(record.key)
        document = {**record.to_json(), "replicas": info.replicas, "saved_at": _now(), "reason": reason,
                    "blob": str(blob.relative_to(self.directory))}
        write_atomically(sidecar, json.dumps(document, indent=1).encode())
        self.saved.add(record.key)
        return sidecar

    def consider(self, info: KeyInfo, record: KeyRecord, data) -> None:
        """Called for every key read whole, with its bytes still in the buffer."""
        if record.xxh3 is None:
            return
        if hasattr(data, "cpu"):  # a CUDA tensor: evidence is kept on the host
            data = data.cpu().numpy()
        if record.is_finding:
            self.save(info, record, data, "finding")
        if record.zero or not record.size:
            return
        content = (record.size, record.xxh3)
        first = self._first_of_content.setdefault(content, (info, record))
        if first[1] is not record:  # identical bytes under another key: both are SHARED_CONTENT
            for other_info, other in (first, (info, record)):
                if other.key not in self.saved:
                    self.save(other_info, other, data, "shared_content")

    def finish(self, report: Report) -> None:
        """Sidecars carry the final verdicts (cross-key ones are known only now); an index lists them."""
        by_key = {record.key: record for record in report.records if record.key in self.saved}
        lines = []
        for key, record in by_key.items():
            sidecar = self.directory / "keys" / key_file_name(key)
            document = json.loads(sidecar.read_text())
            document.update(verdicts=list(record.verdicts), evidence=record.evidence)
            write_atomically(sidecar, json.dumps(document, indent=1).encode())
            lines.append(json.dumps({"key": key, "verdicts": record.verdicts, "sidecar": f"keys/{sidecar.name}",
                                     "blob": document["blob"]}))
        write_atomically(self.directory / "index.jsonl", ("\n".join(lines) + "\n" if lines else "").encode())
