"""A purged key's SSD copies taken out of its holder's offload directory, so that a restarted
holder does not bring the key back.

Mooncake's `remove` leaves the disk copy, and a holder registers at start-up every key its `.meta`
files list (`BucketStorageBackend::Init`, FACTS §11). A bucket holds many keys, so a key is taken
out by rewriting its bucket's `.meta` without the key's entry: the `.bucket` file is left as it is,
the other keys' values stay at the offsets their entries give, and the key's bytes there are no
longer reachable. A bucket left with no key is moved out whole (Mooncake would delete a `.meta`
listing none). Evidence first: each value's bytes and the `.meta` as it was are written to the
evidence directory (names ending `.orig` and `.gz`, which no holder scans) before anything changes.
The file-per-key backend keeps a key in a file of its own, which a restarted holder registers
again too (measured): that file is moved out whole into the evidence directory.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from collections.abc import Container, Iterable
from pathlib import Path

import xxhash

from audit.errors import AuditError
from audit.forensics.evidence import write_atomically
from audit.readers.buckets import StoredValue, meta_without, stored_key
from audit.readers.offload_index import copies_holding

QUARANTINE = "disk-copies"  # under the evidence directory
DEFAULT_TENANT = "default"


def value_bytes(value: StoredValue) -> bytes:
    with open(value.path, "rb") as stored:
        record = os.pread(stored.fileno(), len(value.head) + value.size, value.offset)
    if len(record) != len(value.head) + value.size or not record.startswith(value.head):
        raise AuditError(f"{value.path} at {value.offset}: not the record it was indexed as")
    return record[len(value.head):]


def quarantine(directories: Iterable[Path], names: Iterable[str], evidence_dir: Path,
               places: Container[tuple[str, int]] | None = None, tenant: str = DEFAULT_TENANT) -> dict[str, list[dict]]:
    """Take `tenant`'s keys `names` out of every file of `directories` that holds them (`places`:
    only their copies at these (file, value offset)); per key, one row per copy taken
    out (`how`: `meta-rewritten` or `bucket-moved`, `evidence`: its bytes under the evidence
    directory; `file-moved` for the file-per-key backend). Keys no file there holds are left out."""
    wanted = {stored_key(tenant, name): name for name in names}
    holding = copies_holding(directories, set(wanted))
    if places is not None:
        holding = {path: kept for path, values in holding.items()
                   if (kept := [value for value in values if (str(value.path), value.value_offset) in places])}
    if not holding:
        return {}
    out = Path(evidence_dir) / QUARANTINE
    try:
        out.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as error:
        raise AuditError(f"cannot create {out}: {error.strerror}") from None
    taken: dict[str, list[dict]] = {}
    with open(out / "index.jsonl", "a", encoding="utf-8") as index:
        for path, values in holding.items():
            in_bucket = values[0].in_bucket
            directory = xxhash.xxh3_64_hexdigest(str(path.parent.resolve()).encode())[:8]
            tag = f"{directory}-{path.stem if in_bucket else path.name}"
            rows = [(wanted[value.stored_key], _evidence(value, out / f"{tag}-{value.value_offset}.gz", evidence_dir))
                    for value in values]  # evidence first
            how, moved = _take_out_of_bucket(path, values, out, tag) if in_bucket else _move_key_file(path, out, tag)
            for name, row in rows:
                row["how"] = how
                taken.setdefault(name, []).append(row)
                index.write(json.dumps({"key": name, **row, **moved}) + "\n")
    return taken


def _evidence(value: StoredValue, blob: Path, evidence_dir: Path) -> dict:
    """The value's bytes written to `blob`; the row that says where they came from and went."""
    data = value_bytes(value)
    write_atomically(blob, gzip.compress(data, compresslevel=1))
    return {"file": str(value.path), "offset": value.value_offset, "size": value.size,
            "xxh3": xxhash.xxh3_64_hexdigest(data), "evidence": str(blob.relative_to(evidence_dir))}


def _take_out_of_bucket(meta: Path, values: list[StoredValue], out: Path, tag: str) -> tuple[str, dict]:
    """The bucket's `.meta` rewritten without `values` (kept as it was under `out`); a bucket left
    with no key moved out whole."""
    original = meta.read_bytes()
    kept, remaining = meta_without(original, {value.stored_key for value in values})
    write_atomically(out / f"{tag}.meta.orig", original)
    if remaining:
        write_atomically(meta, kept)
        how = "meta-rewritten"
    else:
        meta.unlink()
        shutil.move(meta.with_suffix(".bucket"), out / f"{tag}.bucket.orig")
        how = "bucket-moved"
    return how, {"meta": str(meta), "meta_orig": f"{tag}.meta.orig"}


def _move_key_file(path: Path, out: Path, tag: str) -> tuple[str, dict]:
    """A file-per-key file moved whole under `out`, where no holder scans."""
    shutil.move(path, out / f"{tag}.orig")
    return "file-moved", {"moved_to": f"{tag}.orig"}
