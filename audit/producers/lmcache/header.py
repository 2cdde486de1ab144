"""LMCache's RemoteMetadata header (0.5.6 `v1/protocol.py`), which `save_chunk_meta` (on by
default) puts before every value its Mooncake connector writes (`put_parts(key, header, kv)`).

int32s in the host's order (little-endian wherever LMCache runs): ``length, fmt``, then per KV layer
group ``dtype, shape[0..3]`` (a shape of fewer dims padded with trailing zeros): 8 + 20 x groups
bytes, 28 for one group. `length` is the KV's bytes, the groups' tensors back to back. LMCache's
reader asserts ``size == header + length`` and allocates by the shapes; the header does not say how
many groups it has (every reader knows its model's), so the reading that fits is searched for.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

# MemoryFormat and DTYPE_TO_INT / INT_TO_DTYPE, measured on 0.5.6 (tests/producers/lmcache_0_5_6.json).
FORMATS = {1: "KV_2LTD", 2: "KV_T2D", 3: "KV_2TD", 4: "BINARY", 5: "BINARY_BUFFER", 6: "KV_MLA_FMT",
           7: "EC_TD", 8: "HS_TD"}
KV_FORMATS = frozenset({1, 2, 3, 6})
DTYPES = {1: ("float16", 2), 2: ("float16", 2), 3: ("bfloat16", 2), 4: ("float32", 4), 5: ("float64", 8),
          6: ("uint8", 1), 7: ("float8_e4m3fn", 1), 8: ("float8_e5m2", 1)}
# The key's dtype spelling (TORCH_DTYPE_TO_STR_DTYPE) -> the header's dtype.
KEY_DTYPES = {"half": "float16", "bfloat16": "bfloat16", "float": "float32", "double": "float64",
              "uint8": "uint8", "fp8_e4m3fn": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
FIXED_BYTES = 8
GROUP_BYTES = 20
MAX_GROUPS = 8


@dataclass(frozen=True, slots=True)
class Group:
    """One KV layer group's tensor: its dtype and its shape, padding stripped."""

    dtype: str
    itemsize: int
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True, slots=True)
class Header:
    length: int
    fmt: int
    groups: tuple[Group, ...]

    @property
    def nbytes(self) -> int:
        return FIXED_BYTES + GROUP_BYTES * len(self.groups)

    @property
    def shape_bytes(self) -> int:
        return sum(group.nbytes for group in self.groups)

    def describe(self) -> dict:
        return {"format": FORMATS[self.fmt], "length": self.length, "header_bytes": self.nbytes,
                "groups": [{"dtype": group.dtype, "shape": list(group.shape)} for group in self.groups]}


def looks_like_header(head: bytes) -> bool:
    """A known format and dtype code where a header has them: a cheap look before parsing."""
    if len(head) < FIXED_BYTES + GROUP_BYTES:
        return False
    _, fmt, dtype = struct.unpack_from("<iii", head)
    return fmt in FORMATS and dtype in DTYPES


def _group(data: bytes, offset: int) -> Group | None:
    code, *dims = struct.unpack_from("<iiiii", data, offset)
    if code not in DTYPES or dims[0] <= 0 or any(dim < 0 for dim in dims):
        return None
    while len(dims) > 1 and dims[-1] == 0:
        dims.pop()
    dtype, itemsize = DTYPES[code]
    return Group(dtype, itemsize, tuple(dims))


def read_header(data: bytes, size: int) -> Header | None:
    """The header `data` (the value's first bytes) starts with, or None when it starts with none
    (its first group unreadable: a headerless value, or a header too damaged to tell from one).

    Of the group counts whose groups parse, the first that agrees with both the value's size and
    its own length wins; else the first that agrees with its length (the value's size is wrong);
    else one group (the header's length is wrong)."""
    if not looks_like_header(data):
        return None
    length, fmt = struct.unpack_from("<ii", data)
    groups: list[Group] = []
    candidates: list[Header] = []
    while len(groups) < MAX_GROUPS and FIXED_BYTES + GROUP_BYTES * (len(groups) + 1) <= len(data):
        group = _group(data, FIXED_BYTES + GROUP_BYTES * len(groups))
        if group is None:
            break
        groups.append(group)
        candidates.append(Header(length, fmt, tuple(groups)))
    if not candidates:
        return None
    for header in candidates:
        if header.shape_bytes == length and header.nbytes + length == size:
            return header
    return next((header for header in candidates if header.shape_bytes == length), candidates[0])

