"""PREFIX_MISMATCH: a state whose layer-0 rows (a conv state's, or an attention block's V) decode
to tokens other than the ones its producer recorded for its chunk hash (`audit.prefixrecords`).

Such a state is the state of *some* prefix under these weights (it binds), just not of the prefix its
key names: another request's, a stale or recycled block's, an earlier boundary's. Only keys with a
prefix record are judged; a token whose image other tokens share (tied or untrained embeddings) may
be any of them, so every such reading is tried before a key is flagged."""

from __future__ import annotations

import itertools
import math

import numpy as np

from audit.prefixrecords import (
    CONV,
    DIGEST,
    TOKEN_BYTES,
    PrefixDigest,
    PrefixRecords,
    digest_value,
    encoded_digest,
    hash_key,
    prefix_digest,
    record_region,
    token_bytes,
    window_and_digest,
)
from audit.prefixtable import PrefixTable
from audit.producers.vllm import split_stem
from audit.records import KeyRecord, Verdict

MAX_READINGS = 256  # token sequences tried for a window of shared images; beyond it, nothing is claimed


def window_tokens(tokens, window: int, region: str) -> list[int] | None:
    """The `window` decoded tokens a record names: a conv state's last `window` rows (the tokens before
    its boundary), an attention block's first `window` V rows (its own tokens from the block's start;
    a partial tail block's later rows hold nothing of it). None: the rows hold fewer tokens."""
    if window > len(tokens):
        return None
    chosen = tokens[len(tokens) - window:] if region == CONV else tokens[:window]
    return chosen.tolist() if isinstance(chosen, np.ndarray) else list(map(int, chosen))


def prefix_matches(tokens, expected: PrefixDigest | int, twins: dict, region: str = CONV) -> bool | None:
    """Whether decoded `tokens` (oldest first) hold the tokens `expected` digests where `region`'s
    record says (`window_tokens`), any token of a class of shared images standing for any other
    (`twins`); None: nothing to say (the rows hold fewer tokens than the window, or the classes
    leave too many readings). `expected` may be a record as the tables keep it (`window_and_digest`):
    a guard compares a load's keys with no record object made."""
    size, wanted = window_and_digest(expected)
    window = window_tokens(tokens, size, region)
    if window is None:
        return None
    digest = digest_value if isinstance(wanted, int) else prefix_digest
    if digest(window) == wanted:
        return True
    classes = [twins.get(token, (token,)) for token in window]
    if math.prod(len(c) for c in classes) > MAX_READINGS:
        return None
    return any(digest(reading) == wanted for reading in itertools.product(*classes))


def encoded_prefix_matches(encoded: memoryview, expected: PrefixDigest | int, region: str = CONV) -> bool:
    """Whether a key's decoded tokens, given as `token_bytes` (a slice of a batch's: no copy), digest
    to `expected` where its record says, as they do as a rule: `prefix_matches`' first test, with no
    list made. False says only that this test did not match (twins, a record's text digest, a short
    window): `prefix_matches` decides those."""
    size, wanted = window_and_digest(expected)
    count = len(encoded) // TOKEN_BYTES
    if not isinstance(wanted, int) or not 0 < size <= count:
        return False
    first = count - size if region == CONV else 0  # a conv state's last tokens, a block's first
    return encoded_digest(encoded[first * TOKEN_BYTES:(first + size) * TOKEN_BYTES]) == wanted


def supplied_rows(chunk_hash: str | None, images, prefixes: PrefixRecords | PrefixTable | None) -> str | None:
    """Why a key's layer-0 rows that are no token's image under `images` are not a finding: they
    may hold embeddings vLLM was given rather than tokens' (docs/binding.md). "recorded": its
    producer recorded its windows as holding some (`supplied_line`); "unrecorded": its model takes
    an encoder's embeddings (`TokenImages.encoder_inputs`) and no record names its tokens. None:
    the rows are a finding."""
    if chunk_hash is not None and prefixes is not None and prefixes.is_supplied(chunk_hash):
        return "recorded"
    if images.encoder_inputs and (chunk_hash is None or prefixes is None
                                  or prefixes.packed(chunk_hash, record_region(images.region)) is None):
        return "unrecorded"
    return None


def check_prefix(record: KeyRecord, tokens: np.ndarray, images, prefixes: PrefixRecords | PrefixTable) -> bool | None:
    """Flag `record` when its decoded layer-0 `tokens` (oldest first) do not digest to its chunk
    hash's record for its region (`images.region`). None: nothing to compare (no record, or
    `prefix_matches` cannot say); True: flagged."""
    split = split_stem(record.key)  # a vLLM key ends in its chunk hash (a key without one has no record)
    region = record_region(images.region)
    expected = prefixes.get(split[1], region) if split else None
    matches = None if expected is None else prefix_matches(tokens, expected, images.twins, region)
    if matches is not False:
        return None if matches is None else False
    window = window_tokens(tokens, expected.window, region)
    if Verdict.PREFIX_MISMATCH not in record.verdicts:  # (its K may have said so: `audit.judge.binding`)
        record.verdicts.append(Verdict.PREFIX_MISMATCH)
    record.evidence["prefix_mismatch"] = {
        "chunk_hash": split[1], "region": images.region, "window": expected.window,
        "recorded_digest": expected.digest, "decoded_digest": prefix_digest(window), "digest": DIGEST,
        "shared_images": sum(token in images.twins for token in window)}
    return True


def check_prefixes(records: list[KeyRecord], token_rows, images, prefixes: PrefixRecords | PrefixTable) -> int:
    """`check_prefix` of each record of `images`' model, its decoded tokens in `token_rows` (arrays,
    or one array of a row a key); how many keys were compared. The keys of one array whose hex
    hashes have table records their tokens digest to are settled at once, with no record object or
    string (`_settled_at_once`: a scan checks a million keys); any other key goes `check_prefix`'s
    whole way."""
    region = record_region(images.region)
    settled = _settled_at_once(records, token_rows, region, prefixes)
    others = np.flatnonzero(~settled).tolist()
    hashed = []  # each other key's hex hash as the tables keep it, None for any other key
    for j in others:
        stem, _, chunk_hash = records[j].key.rpartition("@")
        key = hash_key(chunk_hash) if stem else None
        hashed.append(key if isinstance(key, bytes) else None)
    checked = len(records) - len(others)
    for j, key, packed in zip(others, hashed, prefixes.packed_many(hashed, region)):
        if key is not None and packed is None:
            continue  # a hex hash without a record: nothing to compare
        checked += check_prefix(records[j], token_rows[j], images, prefixes) is not None
    return checked


def hex_hashes(keys: list[str]) -> np.ndarray | None:
    """The chunk hashes of vLLM keys (``...@hash``) as one S{length} array of their bytes, as the tables
    keep them (`hash_key`), with no string or bytes object a key: where every key has one and all are
    hex of one length (a batch of one producer's keys, as a rule); None otherwise."""
    split = [key.rpartition("@") for key in keys]
    if not split:
        return None
    width = len(split[0][2])
    text = "".join(chunk_hash for _, _, chunk_hash in split)
    if not width or width % 2 or len(text) != width * len(split) or not all(stem for stem, _, _ in split):
        return None
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        return None
    if len(raw) * 2 != len(text):  # (fromhex passes over whitespace)
        return None
    return np.frombuffer(raw, f"S{width // 2}")


def _settled_at_once(records: list[KeyRecord], token_rows, region: str, prefixes) -> np.ndarray:
    """Which keys' decoded tokens (`token_rows`: one array of a row a key) digest to their hash's
    table record: vLLM keys whose hashes are hex of one length, looked up and compared as arrays
    (one digest call a key). False for every other key, and for every key of any other batch."""
    settled = np.zeros(len(records), bool)
    if not isinstance(token_rows, np.ndarray) or not isinstance(prefixes, PrefixTable) or not records:
        return settled
    hashes = hex_hashes([record.key for record in records])
    if hashes is None:
        return settled
    found, digests, windows, _ = prefixes.tabled(hashes, region)
    for window in np.unique(windows[found & (windows <= token_rows.shape[1])]).tolist():
        members = np.flatnonzero(found & (windows == window))
        chosen = token_rows[members, token_rows.shape[1] - window:] if region == CONV else token_rows[members, :window]
        encoded, step = token_bytes(chosen), window * TOKEN_BYTES
        decoded = np.array([encoded_digest(encoded[start:start + step]) for start in range(0, len(encoded), step)],
                           np.uint64)
        settled[members] = decoded == digests[members]
    return settled
