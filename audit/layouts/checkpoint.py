"""A checkpoint's tensors, read one by one from its safetensors files (a sharded checkpoint through
its ``model.safetensors.index.json``): binding a state to its tokens needs three or four tensors of
layer 0, never the whole model, and no torch."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np

from .model import LayoutError

INDEX = "model.safetensors.index.json"
# safetensors dtypes a token image can be computed from; anything else (int8, fp8: quantized weights
# and their scales) is named as not bound.
_FLOATS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


class Checkpoint:
    """The safetensors files of one model directory: tensor name -> (file, header entry)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        index = self.directory / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
            files = sorted({self.directory / name for name in weight_map.values()})
        else:
            files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise LayoutError(f"{self.directory}: no safetensors weights (a token image needs the checkpoint)")
        self._entries: dict[str, tuple[Path, int, dict]] = {}
        self.files = files
        for path in files:
            start, header = _header(path)
            for name, entry in header.items():
                if name != "__metadata__":
                    self._entries[name] = (path, start, entry)

    @staticmethod
    def found(directory: Path) -> bool:
        directory = Path(directory)
        return directory.is_dir() and ((directory / INDEX).is_file() or any(directory.glob("*.safetensors")))

    @property
    def identity(self) -> str:
        """Which files, as they are now (path, size, modification time): a cache of what was computed
        from them is stale once this changes. Not a content digest: nothing is read for it."""
        stats = [(str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns) for path in self.files]
        return hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:32]

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def first(self, *names: str) -> str:
        """The first of `names` the checkpoint holds (checkpoints of one family spell some names two ways)."""
        for name in names:
            if name in self._entries:
                return name
        raise LayoutError(f"{self.directory}: none of the tensors {list(names)}")

    def tensor(self, name: str) -> np.ndarray:
        """One tensor, as float32."""
        return self.matrix(name).rows(slice(None))

    def matrix(self, name: str) -> Matrix:
        """One tensor, mapped from its file, not read: its rows are read (as float32) when asked for."""
        if name not in self._entries:
            raise LayoutError(f"{self.directory}: no tensor {name!r}")
        path, start, entry = self._entries[name]
        dtype = _FLOATS.get(entry["dtype"])
        if dtype is None:
            raise LayoutError(f"{name} is {entry['dtype']}: a quantized checkpoint is not bound")
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end == begin:
            return Matrix(np.zeros(shape, dtype=dtype), entry["dtype"])
        return Matrix(np.memmap(path, dtype=dtype, mode="r", offset=start + begin, shape=shape), entry["dtype"])


class Matrix:
    """A tensor in its file's dtype, rows converted to float32 on demand."""

    def __init__(self, raw: np.ndarray, dtype: str):
        self.raw, self.dtype = raw, dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.raw.shape

    def rows(self, index) -> np.ndarray:
        part = self.raw[index]
        if self.dtype == "BF16":  # the upper half of a float32 (little-endian: the second uint16)
            words = np.zeros(part.shape + (2,), dtype=np.uint16)
            words[..., 1] = part
            return words.view(np.float32).reshape(part.shape)
        return np.asarray(part, dtype=np.float32)

    def blocks(self, rows: int):
        """(first row, float32 block) over the whole tensor, `rows` at a time: bounded memory."""
        for first in range(0, self.shape[0], rows):
            yield first, self.rows(slice(first, first + rows))


def _header(path: Path) -> tuple[int, dict]:
    """Where a safetensors file's data starts, and its header (tensor name -> dtype, shape, offsets)."""
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
    except (OSError, struct.error, ValueError) as error:
        raise LayoutError(f"{path}: not a safetensors file ({error})") from None
    return 8 + length, header
