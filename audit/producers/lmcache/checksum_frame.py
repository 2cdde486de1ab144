"""LMCache's `checksum` serde (RFC #4533, PR #4558: multiprocess mode's L2 adapters; not in 0.5.6):
``[1 B version = 1][8 B chunk fingerprint][8 B xxh3_64 of the payload, big-endian][payload]``. The
fingerprint is the ObjectKey's chunk hash bytes, the first 8 (zero-padded when shorter).

A value is read as a frame only where its version byte is 1 and its fingerprint or its digest is
right: raw KV starts with a 1 in one value of 256, but matches 8 more bytes by chance in none.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

VERSION = 1
FINGERPRINT_BYTES = 8
FRAME_BYTES = 1 + FINGERPRINT_BYTES + 8


def fingerprint(chunk_hash_hex: str) -> bytes:
    return bytes.fromhex(chunk_hash_hex)[:FINGERPRINT_BYTES].ljust(FINGERPRINT_BYTES, b"\0")


@dataclass(frozen=True, slots=True)
class Frame:
    fingerprint: bytes
    expected_fingerprint: bytes
    stored_xxh3: int
    payload_xxh3: int

    @property
    def fingerprint_matches(self) -> bool:
        return self.fingerprint == self.expected_fingerprint

    @property
    def digest_matches(self) -> bool:
        return self.stored_xxh3 == self.payload_xxh3

    def describe(self) -> dict:
        return {"serde": "checksum", "version": VERSION, "frame_bytes": FRAME_BYTES,
                "fingerprint": self.fingerprint.hex(), "stored_xxh3": f"{self.stored_xxh3:016x}",
                "payload_xxh3": f"{self.payload_xxh3:016x}"}


def looks_like_frame(head: bytes) -> bool:
    return len(head) >= FRAME_BYTES and head[0] == VERSION


def read_frame(value, chunk_hash_hex: str) -> Frame | None:
    """The frame `value` (a uint8 array) is, or None when it is none (see the module's docstring)."""
    if len(value) < FRAME_BYTES or value[0] != VERSION:
        return None
    frame = Frame(fingerprint=bytes(value[1:1 + FINGERPRINT_BYTES]), expected_fingerprint=fingerprint(chunk_hash_hex),
                  stored_xxh3=int.from_bytes(bytes(value[1 + FINGERPRINT_BYTES:FRAME_BYTES]), "big"),
                  payload_xxh3=xxhash.xxh3_64_intdigest(value[FRAME_BYTES:]))
    return frame if frame.fingerprint_matches or frame.digest_matches else None
