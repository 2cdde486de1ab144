"""Triton kernel: XXH3-64, all-zero flag and NaN/Inf counts of byte regions, in one read.

Design:
- One program per region. XXH3's accumulators are scrambled after every 1 KiB block, a non-linear
  step, so a region's blocks chain and cannot be split across programs without a second pass.
  Parallelism comes from the batch: fine for thousands of values per launch, poor for a handful of
  huge ones.
- Within a block the scramble has not happened yet, so a stripe's contribution to the accumulators
  does not depend on the accumulators: the sum over stripes is a plain (mod 2^64) sum. Each loop
  step loads BLOCKS_PER_STEP blocks as one [block, stripe, lane] tensor of uint64 words, computes
  every block's summed contribution in parallel, and only then chains the blocks through the
  scramble one after another. Wide steps keep many loads in flight on a GPU and keep the number of
  tensor operations low under TRITON_INTERPRET.
- The 8 accumulators are one [8] vector; lane i's "add the data word to lane i^1" is a swap of
  adjacent lanes done once per block sum, not per stripe.
- The zero flag is an OR over all words, tested once at the end; NaN/Inf counts use word-replicated
  masks (see ``float_masks``) so every element in a word is tested at once.
- One launch counts for every float dtype the region may be read as (READINGS of them: bfloat16
  and float16 when a value's dtype is undecided): the masks are a [READINGS] vector against each
  loaded word, so the bytes are read and hashed once for all readings. Per reading two counts come
  back: elements special with a non-zero mantissa, and the other special ones (NaN and Inf where
  the dtype has Inf; for e4m3fn, whose mantissa mask is 0, every special one is in the second).
- Only lengths > 240 that are multiples of 8 at 8-aligned addresses come here; the caller hashes the
  rest on the host (XXH3's short and medium algorithms are different functions).
"""

from __future__ import annotations

import triton
import triton.language as tl

from audit.checks.kernels import xxh3_constants as xc
from audit.checks.kernels.float_masks import MASK_FIELDS

_LANES = tl.constexpr(xc.LANES)
_STRIPES_PER_BLOCK = tl.constexpr(xc.STRIPES_PER_BLOCK)
_STRIPE_BYTES = tl.constexpr(xc.STRIPE_BYTES)
_BLOCK_BYTES = tl.constexpr(xc.BLOCK_BYTES)
_WORDS_PER_BLOCK = tl.constexpr(xc.BLOCK_BYTES // 8)
_WORDS_PER_STRIPE = tl.constexpr(xc.STRIPE_BYTES // 8)
_STRIPE_KEYS = tl.constexpr(xc.STRIPE_KEYS)
_SCRAMBLE_KEYS = tl.constexpr(xc.SCRAMBLE_KEYS)
_LAST_STRIPE_KEYS = tl.constexpr(xc.LAST_STRIPE_KEYS)
_MERGE_KEYS = tl.constexpr(xc.MERGE_KEYS)
_INITIAL_ACCUMULATORS = tl.constexpr(xc.INITIAL_ACCUMULATORS)
_PRIME32_1 = tl.constexpr(xc.PRIME32_1)
_PRIME64_1 = tl.constexpr(xc.PRIME64_1)
_PRIME_MX1 = tl.constexpr(xc.PRIME_MX1)
_MASK_FIELDS = tl.constexpr(len(MASK_FIELDS))
_SPECIAL = tl.constexpr(MASK_FIELDS.index("SPECIAL_MASK"))
_MANTISSA = tl.constexpr(MASK_FIELDS.index("MANTISSA_MASK"))
_LOW = tl.constexpr(MASK_FIELDS.index("LOW_MASK"))
_TOP = tl.constexpr(MASK_FIELDS.index("TOP_BITS"))
_ONES = tl.constexpr(MASK_FIELDS.index("ONES"))
_ELEMENT_BITS = tl.constexpr(MASK_FIELDS.index("ELEMENT_BITS"))


@triton.jit
def _swap_adjacent_lanes(x):
    """[..., 8] -> [..., 8] with lanes 2j and 2j+1 exchanged (XXH3 adds lane i's data to i^1)."""
    pairs = tl.reshape(x, x.shape[:-1] + [x.shape[-1] // 2, 2])
    even, odd = tl.split(pairs)
    return tl.reshape(tl.join(odd, even), x.shape)


@triton.jit
def _stripe_products(words, keys):
    """XXH3's per-lane product: low half times high half of (data xor secret)."""
    keyed = words ^ keys
    return (keyed & 0xFFFFFFFF) * (keyed >> 32)


@triton.jit
def _count_flagged(flags, element_bits, ones):
    """Per word, how many elements have their top bit set in ``flags`` (at most 8, no overflow)."""
    return ((flags >> (element_bits - 1)) * ones) >> (64 - element_bits)


@triton.jit
def region_check_kernel(
    buf_ptr,  # *u8: the buffer holding all regions
    offsets_ptr,  # *i64: region start, in bytes (8-aligned address)
    lengths_ptr,  # *i64: region length, in bytes (> 240, multiple of 8)
    secret_ptr,  # *i64: xxh3_constants.secret_table()
    masks_ptr,  # *i64 [READINGS, MASK_FIELDS]: float_masks.mask_table() of the dtypes counted
    out_ptr,  # *i64 [regions, out_stride]: xxh3 bits, all-zero flag, then two counts per reading
    out_stride,  # i64: elements per row of out (at least 2 + 2 * READINGS)
    BLOCKS_PER_STEP: tl.constexpr,
    READINGS: tl.constexpr,  # float dtypes counted, a power of two (rows of masks_ptr)
    COUNT: tl.constexpr,  # False: no float dtype, no NaN/Inf work (counts stay 0)
):
    region = tl.program_id(0)
    length = tl.load(lengths_ptr + region)
    words_ptr = (buf_ptr + tl.load(offsets_ptr + region)).to(tl.pointer_type(tl.uint64))
    n_words = length // 8
    hashed_stripes = (length - 1) // _STRIPE_BYTES  # all stripes but the final one, in order
    scrambled_blocks = (length - 1) // _BLOCK_BYTES  # the last block is never scrambled

    block = tl.arange(0, BLOCKS_PER_STEP)[:, None, None]
    stripe = tl.arange(0, _STRIPES_PER_BLOCK)[None, :, None]
    lane = tl.arange(0, _LANES)[None, None, :]
    word_in_step = block * _WORDS_PER_BLOCK + stripe * _WORDS_PER_STRIPE + lane
    stripe_in_step = block * _STRIPES_PER_BLOCK + stripe
    block_row = tl.arange(0, BLOCKS_PER_STEP)[:, None]

    lane_1d = tl.arange(0, _LANES)
    stripe_keys = tl.load(secret_ptr + _STRIPE_KEYS + stripe * _LANES + lane).to(tl.uint64, bitcast=True)
    scramble_keys = tl.load(secret_ptr + _SCRAMBLE_KEYS + lane_1d).to(tl.uint64, bitcast=True)
    acc = tl.load(secret_ptr + _INITIAL_ACCUMULATORS + lane_1d).to(tl.uint64, bitcast=True)

    # One column per reading: every loaded word is tested against each dtype's masks at once.
    reading = tl.arange(0, READINGS)
    mask_row = masks_ptr + reading[None, None, None, :] * _MASK_FIELDS
    special_mask = tl.load(mask_row + _SPECIAL).to(tl.uint64, bitcast=True)
    mantissa_mask = tl.load(mask_row + _MANTISSA).to(tl.uint64, bitcast=True)
    low_mask = tl.load(mask_row + _LOW).to(tl.uint64, bitcast=True)
    top_bits = tl.load(mask_row + _TOP).to(tl.uint64, bitcast=True)
    ones = tl.load(mask_row + _ONES).to(tl.uint64, bitcast=True)
    element_bits = tl.load(mask_row + _ELEMENT_BITS).to(tl.uint64, bitcast=True)

    any_bits = tl.zeros([BLOCKS_PER_STEP, _STRIPES_PER_BLOCK, _LANES], tl.uint64)
    with_mantissa = tl.zeros([BLOCKS_PER_STEP, _STRIPES_PER_BLOCK, _LANES, READINGS], tl.uint64)
    without = tl.zeros([BLOCKS_PER_STEP, _STRIPES_PER_BLOCK, _LANES, READINGS], tl.uint64)

    words_per_step = BLOCKS_PER_STEP * _WORDS_PER_BLOCK
    for step in range(0, tl.cdiv(n_words, words_per_step)):
        word_index = step * words_per_step + word_in_step
        words = tl.load(words_ptr + word_index, mask=word_index < n_words, other=0)
        any_bits |= words
        if COUNT:  # padding words are 0, which is never special
            # Top bit set where the special bits are all ones. "^ top_bits" rather than "~" because
            # the interpreter cannot invert uint64.
            each = words[:, :, :, None]
            special = ((((each & special_mask) ^ special_mask) + low_mask) & top_bits) ^ top_bits
            flagged = special & (((each & mantissa_mask) + low_mask) & top_bits)
            with_mantissa += _count_flagged(flagged, element_bits, ones)
            without += _count_flagged(special ^ flagged, element_bits, ones)

        hashed = (step * BLOCKS_PER_STEP * _STRIPES_PER_BLOCK + stripe_in_step) < hashed_stripes
        products = tl.sum(tl.where(hashed, _stripe_products(words, stripe_keys), 0), axis=1)
        data = tl.sum(tl.where(hashed, words, 0), axis=1)
        block_gain = products + _swap_adjacent_lanes(data)  # [block, lane]

        for b in tl.static_range(BLOCKS_PER_STEP):
            acc += tl.sum(tl.where(block_row == b, block_gain, 0), axis=0)
            scrambled = ((acc ^ (acc >> 47)) ^ scramble_keys) * _PRIME32_1
            acc = tl.where(step * BLOCKS_PER_STEP + b < scrambled_blocks, scrambled, acc)

    last_stripe = tl.load(words_ptr + n_words - _WORDS_PER_STRIPE + lane_1d)
    last_keys = tl.load(secret_ptr + _LAST_STRIPE_KEYS + lane_1d).to(tl.uint64, bitcast=True)
    acc += _stripe_products(last_stripe, last_keys) + _swap_adjacent_lanes(last_stripe)

    merge_keys = tl.load(secret_ptr + _MERGE_KEYS + lane_1d).to(tl.uint64, bitcast=True)
    even, odd = tl.split(tl.reshape(acc ^ merge_keys, [_LANES // 2, 2]))
    folded = (even * odd) ^ tl.umulhi(even, odd)  # 64x64->128 product, halves xor-ed
    digest = length.to(tl.uint64) * _PRIME64_1 + tl.sum(folded, axis=0)
    digest ^= digest >> 37
    digest *= _PRIME_MX1
    digest ^= digest >> 32

    out = out_ptr + region * out_stride
    tl.store(out + 0, digest.to(tl.int64, bitcast=True))
    tl.store(out + 1, (tl.max(any_bits) == 0).to(tl.int64))
    counted = tl.sum(tl.sum(tl.sum(with_mantissa, axis=0), axis=0), axis=0)
    tl.store(out + 2 + 2 * reading, counted.to(tl.int64, bitcast=True))
    counted = tl.sum(tl.sum(tl.sum(without, axis=0), axis=0), axis=0)
    tl.store(out + 3 + 2 * reading, counted.to(tl.int64, bitcast=True))
