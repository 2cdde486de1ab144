"""XXH3-64 constants, and the default secret pre-read into the 64-bit words the long-input
algorithm uses, so the kernel never does unaligned secret reads (the last-stripe key starts at
byte 121) and only loads one small table.

Source: xxHash's ``doc/xxhash_spec.md`` (seed 0, default 192-byte secret).
"""

from __future__ import annotations

import numpy as np

PRIME32_1 = 0x9E3779B1
PRIME32_2 = 0x85EBCA77
PRIME32_3 = 0xC2B2AE3D
PRIME64_1 = 0x9E3779B185EBCA87
PRIME64_2 = 0xC2B2AE3D27D4EB4F
PRIME64_3 = 0x165667B19E3779F9
PRIME64_4 = 0x85EBCA77C2B2AE63
PRIME64_5 = 0x27D4EB2F165667C5
PRIME_MX1 = 0x165667919E3779F9  # multiplier of XXH3's final avalanche

DEFAULT_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)

STRIPE_BYTES = 64
LANES = 8  # 64-bit accumulators, one per 8-byte lane of a stripe
STRIPES_PER_BLOCK = (len(DEFAULT_SECRET) - STRIPE_BYTES) // 8  # 16
BLOCK_BYTES = STRIPE_BYTES * STRIPES_PER_BLOCK  # 1024: accumulators are scrambled once per block
MIDSIZE_MAX = 240  # inputs up to this length use XXH3's short/medium algorithms, not the kernel's

_SCRAMBLE_OFFSET = len(DEFAULT_SECRET) - STRIPE_BYTES
_LAST_STRIPE_OFFSET = len(DEFAULT_SECRET) - STRIPE_BYTES - 7
_MERGE_OFFSET = 11

# Layout of the secret table, in 64-bit words.
STRIPE_KEYS = 0  # [stripe, lane] -> secret word at byte 8*stripe + 8*lane
SCRAMBLE_KEYS = STRIPE_KEYS + STRIPES_PER_BLOCK * LANES
LAST_STRIPE_KEYS = SCRAMBLE_KEYS + LANES
MERGE_KEYS = LAST_STRIPE_KEYS + LANES
INITIAL_ACCUMULATORS = MERGE_KEYS + LANES
SECRET_TABLE_WORDS = INITIAL_ACCUMULATORS + LANES

_INITIAL_ACCUMULATORS = (
    PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1
)


def _secret_words(byte_offset: int) -> list[int]:
    return [int.from_bytes(DEFAULT_SECRET[byte_offset + 8 * lane:][:8], "little") for lane in range(LANES)]


def secret_table() -> np.ndarray:
    """The table described by the ``*_KEYS`` offsets, as int64 words (bit patterns of uint64)."""
    words: list[int] = []
    for stripe in range(STRIPES_PER_BLOCK):
        words += _secret_words(8 * stripe)
    words += _secret_words(_SCRAMBLE_OFFSET)
    words += _secret_words(_LAST_STRIPE_OFFSET)
    words += _secret_words(_MERGE_OFFSET)
    words += _INITIAL_ACCUMULATORS
    assert len(words) == SECRET_TABLE_WORDS
    return np.array(words, dtype=np.uint64).view(np.int64)
