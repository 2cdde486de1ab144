"""The producers' prefix records: for each chunk hash a vLLM producer computed, a digest of the tokens
that a state published under it must hold at layer 0.

A recurrent state at a block boundary holds, at layer 0, the conv inputs of the last ``window`` tokens
before the boundary (``window`` = the conv kernel - 1), each a function of its token alone
(docs/binding.md). The recorder plugin writes, per chunk hash of every request its scheduler sees,
the digest of those tokens; the scan decodes the tokens back from a key's bytes and compares
(`PREFIX_MISMATCH`: the state of another prefix under this hash: stale, recycled, another
request's). An attention block's KV holds, at layer 0, the V of each of the block's own tokens (a
partial tail block: those up to its boundary), so a hash also names a second window: the tokens from
its block's start to the boundary. Files ``prefixes-{host}-{pid}-{n:04d}.jsonl``, beside the put
records, a line each:

    version 1: {"hash": str (the chunk hash, as the key's last field), "window": int, "digest": str}
    version 2: {"v": 2, "hash": str, and either or both of "window"/"digest" (the conv window) and
                "kv_window"/"kv_digest" (the KV block's tokens, oldest first), and with a KV block
                optionally "kv_start": int (its first token's position in the prompt; its K is
                turned to it, `audit.layouts.rotary`)}
               or {"v": 2, "hash": str, "supplied": true}: a window of the hash holds positions
                whose layer-0 input was an embedding given to vLLM, not a token's (a multimodal
                item's encoder output, prompt embeddings): its rows are no token's image, and
                nothing is claimed of them (`supplied_line`)

A version-1 line reads as a conv window; a version-1 reader reads a version-2 line's conv window
and counts a line with only a KV window as malformed (passed over).

Only a digest is kept, never the tokens: a record file then does not hold the prompts. It is not a
secret either (a few tokens can be searched for): keep record directories as private as the logs.
"""

from __future__ import annotations

import itertools
import re
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from audit.recordfiles import Malformed

PREFIX_RECORD_PREFIX = "prefixes-"
DIGEST = "xxh3_64 of the tokens as little-endian int64"
_INT64 = np.dtype("<i8")
TOKEN_BYTES = _INT64.itemsize  # a token's bytes in `token_bytes`: slices of a batch's are a key's


def token_bytes(tokens) -> memoryview:
    """`tokens` as the digest reads them: little-endian int64, oldest first (an array of a row a key:
    each row in turn). A few tokens at a time, so a list through `array`, not numpy."""
    if isinstance(tokens, np.ndarray):
        return memoryview(np.ascontiguousarray(tokens, _INT64)).cast("B")
    packed = array("q", tokens if isinstance(tokens, list) else map(int, tokens))
    if sys.byteorder == "big":
        packed.byteswap()
    return memoryview(packed).cast("B")


def digest_value(tokens) -> int:
    """The digest of `tokens`, oldest first, as an integer (the recorder's, the guards' and the scan's:
    one function, over `token_bytes`)."""
    return encoded_digest(token_bytes(tokens))


def encoded_digest(encoded) -> int:
    """`digest_value` of tokens already `token_bytes` (a slice of a batch's: no copy)."""
    return xxhash.xxh3_64_intdigest(encoded)


def prefix_digest(tokens: Sequence[int]) -> str:
    """`digest_value` as the records write it: 16 hex digits."""
    return f"{digest_value(tokens):016x}"


def prefix_line(chunk_hash: str, window: int | None, tokens: Sequence[int] | None,
                kv_tokens: Sequence[int] | None = None, kv_start: int | None = None) -> str:
    """A record of `chunk_hash`: its conv window's `tokens` (`window` of them), its KV block's
    `kv_tokens` from position `kv_start`, or both; a conv window alone is written as version 1 (what
    older readers read)."""
    conv = "" if window is None else f',"window":{int(window)},"digest":"{prefix_digest(tokens)}"'
    if kv_tokens is None:
        return f'{{"hash":"{chunk_hash}"{conv}}}'
    start = "" if kv_start is None else f',"kv_start":{int(kv_start)}'
    return (f'{{"v":2,"hash":"{chunk_hash}"{conv},"kv_window":{len(kv_tokens)},'
            f'"kv_digest":"{prefix_digest(kv_tokens)}"{start}}}')


def supplied_line(chunk_hash: str) -> str:
    """A record of `chunk_hash` whose windows hold positions of supplied embeddings (no digest:
    what they hold is not a token)."""
    return f'{{"v":2,"hash":"{chunk_hash}","supplied":true}}'


@dataclass(frozen=True, slots=True)
class PrefixDigest:
    window: int
    digest: str
    start: int | None = None  # a KV block's first position, where recorded


# What a record's window names, by the layer-0 region whose rows hold its tokens (`TokenImages.region`):
# a conv state's last `window` rows, an attention page's first `window` V rows (an MLA page's latent
# rows alike: KV too).
CONV, KV = "conv", "v"


def record_region(image_region: str) -> str:
    """The record kind whose window a layer-0 region's rows are checked against (`TokenImages.region`):
    a conv state's, or a block's own tokens for every page (V rows, MLA latents)."""
    return CONV if image_region == CONV else KV


_DIGEST = re.compile(r"[0-9a-f]{16}")


def hash_key(chunk_hash: str) -> bytes | str:
    """A chunk hash as the tables keep it: a hex hash (vLLM's ``block_hash.hex()``) as its bytes,
    half its text's memory at a million hashes; anything else as its text, lowercase. (`fromhex`
    passes over whitespace and refuses anything else but hex digits: two digits a byte is hex.)"""
    try:
        hashed = bytes.fromhex(chunk_hash)
    except ValueError:
        hashed = b""
    return hashed if hashed and len(hashed) * 2 == len(chunk_hash) else chunk_hash.lower()


_U64 = (1 << 64) - 1
START_LIMIT = 1 << 32  # a KV block's start is packed below this


def packed_record(digest: int, window: int, start: int | None = None) -> int:
    """A record as one integer: ``(start + 1) << 96 | digest << 32 | window`` (no start: 0 above the digest)."""
    return (0 if start is None else start + 1) << 96 | digest << 32 | window


def _packed(entry: PrefixDigest) -> int | PrefixDigest:
    """A record's window, 16-hex-digit digest and start as one integer (an object less per hash)."""
    if _DIGEST.fullmatch(entry.digest) and 0 < entry.window < 1 << 32 \
            and (entry.start is None or 0 <= entry.start < START_LIMIT - 1):
        return packed_record(int(entry.digest, 16), entry.window, entry.start)
    return entry


def unpacked(value: int | PrefixDigest | None) -> PrefixDigest | None:
    if not isinstance(value, int):
        return value
    return PrefixDigest(value & 0xFFFFFFFF, f"{value >> 32 & _U64:016x}", record_start(value))


def window_and_digest(value: int | PrefixDigest) -> tuple[int, int | str]:
    """A record as kept, read with no record object made: its window, and its digest as
    `digest_value`'s integer where packed, else as the record wrote it (`prefix_digest`'s text)."""
    return (value & 0xFFFFFFFF, value >> 32 & _U64) if isinstance(value, int) else (value.window, value.digest)


def record_start(value: int | PrefixDigest | None) -> int | None:
    """A KV block record's first position, where it was recorded (None: not recorded, or no record)."""
    if isinstance(value, int):
        return (value >> 96) - 1 if value >> 96 else None
    return None if value is None else value.start


@dataclass
class PrefixRecords:
    """Chunk hash -> what its state's layer-0 tokens digest to (`digests`: conv windows; `blocks`:
    KV blocks' tokens; kept packed, `hash_key` and `_packed`), added a line at a time (the guards
    read the records being written; a scan's are `audit.prefixtable`'s); `conflicts`: hashes
    recorded with two different digests (kept out: nothing is claimed of them); `supplied`: hashes
    whose windows hold supplied embeddings (`supplied_line`), as `hash_key`s (values unused)."""

    digests: dict = field(default_factory=dict)
    blocks: dict = field(default_factory=dict)
    supplied: dict = field(default_factory=dict)
    conflicts: set[str] = field(default_factory=set)
    records: int = 0
    skipped: int = 0  # malformed lines (a line being appended as the scan read included)

    def get(self, chunk_hash: str, region: str = CONV) -> PrefixDigest | None:
        return unpacked(self.packed(chunk_hash, region))

    def packed(self, chunk_hash: str, region: str = CONV) -> int | PrefixDigest | None:
        """`get` as kept: most records one integer, `(digest_value << 32) | window` (`_packed`)."""
        return (self.blocks if region == KV else self.digests).get(hash_key(chunk_hash))

    def packed_many(self, keys: list, region: str = CONV) -> list:
        """`packed` of hashes given as their `hash_key` (None: no record)."""
        table = self.blocks if region == KV else self.digests
        return [None if key is None else table.get(key) for key in keys]

    def is_supplied(self, chunk_hash: str) -> bool:
        """Whether the hash's windows hold supplied embeddings, as its producer recorded."""
        return bool(self.supplied) and hash_key(chunk_hash) in self.supplied

    def add(self, chunk_hash: str, entry: PrefixDigest | None, block: PrefixDigest | None = None,
            supplied: bool = False) -> None:
        if supplied:
            self.records += 1
            self.supplied[hash_key(chunk_hash)] = None
            return
        self.add_packed(hash_key(chunk_hash), chunk_hash.lower(),
                        None if entry is None else _packed(entry), None if block is None else _packed(block))

    def add_packed(self, key, chunk_hash: str, entry, block) -> None:
        """`add` of a hash already lowercase and its `hash_key`, and values already `_packed`."""
        self.records += 1
        if self.conflicts and chunk_hash in self.conflicts:
            return
        if (entry is None or self.digests.setdefault(key, entry) == entry) and \
                (block is None or self.blocks.setdefault(key, block) == block):
            return  # new, or as recorded before
        self.digests.pop(key, None)
        self.blocks.pop(key, None)
        self.conflicts.add(chunk_hash)

    def trim(self, capacity: int) -> None:
        """Past `capacity` hashes in either table, its oldest half goes (a guard's records are read for a while)."""
        for table in (self.digests, self.blocks, self.supplied):
            if len(table) > capacity:
                for stale in list(itertools.islice(table, len(table) - capacity // 2)):
                    del table[stale]

    def __len__(self) -> int:
        return len(self.digests.keys() | self.blocks.keys())


def prefix_record_paths(paths: Iterable[Path]) -> list[Path]:
    """The prefix-record files among `paths` (directories: recursively)."""
    found: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found.extend(sorted(p for p in path.rglob(PREFIX_RECORD_PREFIX + "*.jsonl*") if p.is_file()))
        elif path.name.startswith(PREFIX_RECORD_PREFIX):
            found.append(path)
    return found


def _window(record: dict, window: str, digest: str, start: str | None = None) -> PrefixDigest | None:
    count, value = record.get(window), record.get(digest)
    if count is None and value is None:
        return None
    if not isinstance(value, str) or type(count) is not int or count < 1:
        raise Malformed(f"{digest} must be a string, {window} a positive integer")
    first = None if start is None else record.get(start)
    if first is not None and (type(first) is not int or first < 0):
        raise Malformed(f"{start} must be a non-negative integer")
    return PrefixDigest(count, value, first)


def parse_prefix_record(record: dict) -> tuple[str, PrefixDigest | None, PrefixDigest | None, bool]:
    """(hash, conv window, KV block, whether its windows hold supplied embeddings) of a version-1
    or version-2 line; a later version is malformed (its fields may mean something else)."""
    chunk_hash, version = record.get("hash"), record.get("v", 1)
    if not isinstance(chunk_hash, str):
        raise Malformed("hash must be a string")
    if version not in (1, 2) or type(version) is not int:
        raise Malformed(f"prefix record version {version!r} is not one this audit reads (1, 2)")
    if version == 2 and "supplied" in record:
        if record["supplied"] is not True or {"window", "kv_window"} & record.keys():
            raise Malformed("supplied must be true, in a line naming no window")
        return chunk_hash, None, None, True
    conv = _window(record, "window", "digest")
    block = _window(record, "kv_window", "kv_digest", "kv_start") if version == 2 else None
    if conv is None and block is None:
        raise Malformed("a prefix record names a conv window, a KV block or both")
    return chunk_hash, conv, block, False


# The recorder's own lines (`prefix_line`), read without a JSON parser: a million records a scan.
# Each reads as json.loads would read it (lowercase hex, no escapes, positive integers); any other
# line takes the JSON path.
RECORDER_LINE = re.compile(r'\{(?:"v":2,)?"hash":"([0-9a-f]+)"(?:,"window":([1-9][0-9]{0,8}),'
                            r'"digest":"([0-9a-f]{16})")?(?:,"kv_window":([1-9][0-9]{0,8}),"kv_digest":"([0-9a-f]{16})"'
                            r'(?:,"kv_start":(0|[1-9][0-9]{0,8}))?)?\}\s*')


def recorder_line(line: str) -> tuple | None:
    """(its `hash_key`, hash, packed conv window, packed KV block) of a line as the recorder writes
    it; None otherwise."""
    found = RECORDER_LINE.fullmatch(line)
    if found is None:
        return None
    chunk_hash, window, digest, kv_window, kv_digest, kv_start = found.groups()
    if window is None and kv_window is None or kv_window is not None and not line.startswith('{"v":2,') \
            or len(chunk_hash) % 2:
        return None  # neither window, a KV block in a version-1 line, an odd hex hash: the JSON path
    return (bytes.fromhex(chunk_hash), chunk_hash, None if window is None else int(digest, 16) << 32 | int(window),
            None if kv_window is None else packed_record(int(kv_digest, 16), int(kv_window),
                                                         None if kv_start is None else int(kv_start)))
