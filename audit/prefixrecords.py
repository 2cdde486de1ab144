"""The producers' prefix records: for each chunk hash a vLLM producer computed, a digest of the tokens
that a state published under it must hold at layer 0.

A recurrent state at a block boundary holds, at layer 0, the conv inputs of the last ``window`` tokens
before the boundary (``window`` = the conv kernel - 1), each a function of its token alone
(docs/binding.md). The recorder plugin writes, per chunk hash of every request its scheduler sees,
the digest of those tokens; the scan decodes the tokens back from a key's bytes and compares
(`PREFIX_MISMATCH`: the state of another prefix under this hash: stale, recycled, another
request's). Files ``prefixes-{host}-{pid}-{n:04d}.jsonl``, beside the put records, a line each:

    {"hash": str (the chunk hash, as the key's last field), "window": int, "digest": str}

Only a digest is kept, never the tokens: a record file then does not hold the prompts. It is not a
secret either (a few tokens can be searched for): keep record directories as private as the logs.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from audit.recordfiles import Malformed, numbered_lines, parsed_lines

PREFIX_RECORD_PREFIX = "prefixes-"
DIGEST = "xxh3_64 of the tokens as little-endian int64"


def prefix_digest(tokens: Sequence[int]) -> str:
    """The digest of `tokens`, oldest first (the recorder's, the guards' and the scan's: one function;
    a few tokens at a time, so through `array`, not numpy)."""
    packed = array("q", (int(token) for token in tokens))
    if sys.byteorder == "big":
        packed.byteswap()
    return xxhash.xxh3_64_hexdigest(packed.tobytes())


def prefix_line(chunk_hash: str, window: int, tokens: Sequence[int]) -> str:
    return f'{{"hash":"{chunk_hash}","window":{int(window)},"digest":"{prefix_digest(tokens)}"}}'


@dataclass(frozen=True, slots=True)
class PrefixDigest:
    window: int
    digest: str


@dataclass
class PrefixRecords:
    """Chunk hash -> what its state's layer-0 tokens digest to; `conflicts`: hashes recorded with
    two different digests (kept out: nothing is claimed of them)."""

    digests: dict[str, PrefixDigest] = field(default_factory=dict)
    conflicts: set[str] = field(default_factory=set)
    records: int = 0
    skipped: int = 0  # malformed lines (a line being appended as the scan read included)

    def get(self, chunk_hash: str) -> PrefixDigest | None:
        return self.digests.get(chunk_hash.lower())

    def add(self, chunk_hash: str, entry: PrefixDigest) -> None:
        chunk_hash = chunk_hash.lower()
        self.records += 1
        if chunk_hash in self.conflicts:
            return
        known = self.digests.get(chunk_hash)
        if known is None:
            self.digests[chunk_hash] = entry
        elif known != entry:
            del self.digests[chunk_hash]
            self.conflicts.add(chunk_hash)

    def __len__(self) -> int:
        return len(self.digests)


def prefix_record_paths(paths: Iterable[Path]) -> list[Path]:
    """The prefix-record files among `paths` (directories: recursively)."""
    found: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found.extend(sorted(p for p in path.rglob(PREFIX_RECORD_PREFIX + "*.jsonl*") if p.is_file()))
        elif path.name.startswith(PREFIX_RECORD_PREFIX):
            found.append(path)
    return found


def parse_prefix_record(record: dict) -> tuple[str, PrefixDigest]:
    chunk_hash, window, digest = record.get("hash"), record.get("window"), record.get("digest")
    if not isinstance(chunk_hash, str) or not isinstance(digest, str) or type(window) is not int or window < 1:
        raise Malformed("hash and digest must be strings, window a positive integer")
    return chunk_hash, PrefixDigest(window, digest)


def read_prefix_records(paths: Iterable[Path]) -> PrefixRecords:
    """Every prefix record under `paths`; a malformed line is counted and passed over, never fatal."""
    result = PrefixRecords()

    def skipped() -> None:
        result.skipped += 1

    for path in prefix_record_paths(paths):
        for _, parsed in parsed_lines(numbered_lines(path, "prefix record"), path, "prefix record", parse_prefix_record,
                                      lenient=True, skipped=skipped):
            result.add(*parsed)
    return result
