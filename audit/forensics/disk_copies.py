"""A purged key's SSD copies taken out of its holder's offload directory (bucket backend), so that
a restarted holder does not bring the key back.

Mooncake's `remove` leaves the disk copy, and a holder registers at start-up every key its `.meta`
files list (`BucketStorageBackend::Init`, FACTS §11). A bucket holds many keys, so a key is taken
out by rewriting its bucket's `.meta` without the key's entry: the `.bucket` file is left as it is,
the other keys' values stay at the offsets their entries give, and the key's bytes there are no
longer reachable. A bucket left with no key is moved out whole (Mooncake would delete a `.meta`
listing none). Evidence first: each value's bytes and the `.meta` as it was are written to the
evidence directory (names ending `.orig` and `.gz`, which no holder scans) before anything changes.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import xxhash

from audit.errors import AuditError
from audit.forensics.evidence import write_atomically
from audit.readers.buckets import StoredValue, buckets_holding, meta_without, stored_key

QUARANTINE = "disk-copies"  # under the evidence directory
DEFAULT_TENANT = "default"


def _value_bytes(value: StoredValue) -> bytes:
    with open(value.path, "rb") as bucket:
        record = os.pread(bucket.fileno(), value.key_size + value.size, value.offset)
    if len(record) != value.key_size + value.size or record[:value.key_size] != value.stored_key:
        raise AuditError(f"{value.path} at {value.offset}: not the record its .meta lists")
    return record[value.key_size:]


def quarantine(directories: Iterable[Path], names: Iterable[str], evidence_dir: Path) -> dict[str, list[dict]]:
    """Take the default-tenant keys `names` out of every bucket of `directories` that lists them;
    per key, one row per copy taken out (`how`: `meta-rewritten` or `bucket-moved`, `evidence`:
    its bytes under the evidence directory). Keys no bucket there lists are left out."""
    wanted = {stored_key(DEFAULT_TENANT, name): name for name in names}
    holding = buckets_holding(directories, set(wanted))
    if not holding:
        return {}
    out = Path(evidence_dir) / QUARANTINE
    try:
        out.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as error:
        raise AuditError(f"cannot create {out}: {error.strerror}") from None
    taken: dict[str, list[dict]] = {}
    with open(out / "index.jsonl", "a", encoding="utf-8") as index:
        for meta, values in holding.items():
            tag = f"{xxhash.xxh3_64_hexdigest(str(meta.parent.resolve()).encode())[:8]}-{meta.stem}"
            original = meta.read_bytes()
            kept, remaining = meta_without(original, {value.stored_key for value in values})
            rows = []
            for value in values:  # evidence first
                data = _value_bytes(value)
                blob = out / f"{tag}-{value.value_offset}.gz"
                write_atomically(blob, gzip.compress(data, compresslevel=1))
                rows.append((wanted[value.stored_key], {
                    "file": str(value.path), "offset": value.value_offset, "size": value.size,
                    "xxh3": xxhash.xxh3_64_hexdigest(data), "evidence": str(blob.relative_to(evidence_dir))}))
            write_atomically(out / f"{tag}.meta.orig", original)
            if remaining:
                write_atomically(meta, kept)
                how = "meta-rewritten"
            else:
                meta.unlink()
                shutil.move(meta.with_suffix(".bucket"), out / f"{tag}.bucket.orig")
                how = "bucket-moved"
            for name, row in rows:
                row["how"] = how
                taken.setdefault(name, []).append(row)
                index.write(json.dumps({"key": name, **row, "meta": str(meta), "meta_orig": f"{tag}.meta.orig"}) + "\n")
    return taken
