"""A ``.gguf`` file read in place: its metadata, and each tensor's bytes as the file stores them.

``gguf.GGUFReader`` builds a Python object per element of every metadata array, so a
file with a 151k-token vocabulary takes it 19 s to open (Qwen2.5-0.5B here); this reader
keeps arrays of strings as offsets until asked (the tokenizer asks, the model does not) and
opens the same file in about 0.1 s. Tensor data is a read-only view of a memory map: nothing
is copied until a caller converts it, and pages the caller never touches are never read.

The format (ggml's docs/gguf.md): ``GGUF``, a version (2 or 3), the tensor and metadata
counts, the metadata as typed key/value pairs, then per tensor its name, dims (fastest
first), type and offset, and the data section at the next multiple of ``general.alignment``.
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types -> (struct format, size); 8 = string and 9 = array are read apart.
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands, or it is cut short."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # rows first (numpy order): ggml's dims reversed
    type: int  # a gguf.GGMLQuantizationType value
    offset: int  # from the start of the file
    nbytes: int


class StringArray:
    """An array of strings left in the file until read: ``len()``, ``[i]``, ``list()``."""

    def __init__(self, buffer: Any, start: int, count: int) -> None:
        self._buffer, self._start, self._count = buffer, start, count
        self._items: list[str] | None = None

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        return self.tolist()[index]

    def __iter__(self):
        return iter(self.tolist())

    def tolist(self) -> list[str]:
        if self._items is None:
            buffer, pos, items = self._buffer, self._start, []
            unpack = struct.unpack_from
            for _ in range(self._count):
                (length,) = unpack("<Q", buffer, pos)
                items.append(bytes(buffer[pos + 8:pos + 8 + length]).decode("utf-8", errors="replace"))
                pos += 8 + length
            self._items = items
        return self._items


class GGUFFile:
    """Metadata (``metadata``: key -> int / float / bool / str / numpy array / StringArray) and
    tensors (``tensors``: name -> TensorInfo; ``data(name)`` its bytes) of one .gguf file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            try:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as error:  # an empty file
                raise GGUFFormatError(f"{self.path} is empty") from error
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError) as error:
            raise GGUFFormatError(f"{self.path} is cut short or damaged ({error})") from None

    # --- reading -------------------------------------------------------------------------

    def _parse(self) -> None:
        buf = self._map
        if buf[:4] != MAGIC:
            raise GGUFFormatError(f"{self.path} is not a GGUF file (it starts with {bytes(buf[:4])!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise GGUFFormatError(f"{self.path} is GGUF version {version}; this reader knows versions 2 and 3")
        self.version = version
        pos = 24
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (kind,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            self.metadata[key], pos = self._value(kind, pos)
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, tuple(reversed(dims)), kind, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = self.data_start = -(-pos // alignment) * alignment
        for name, shape, kind, offset in infos:
            nbytes = _tensor_nbytes(shape, kind)
            start = data_start + offset
            if start + nbytes > len(buf):
                raise GGUFFormatError(f"{self.path} is cut short: tensor {name} ends at byte {start + nbytes}, "
                                      f"the file at {len(buf)}")
            self.tensors[name] = TensorInfo(name, shape, kind, start, nbytes)

    def _string(self, pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._map, pos)
        return bytes(self._map[pos + 8:pos + 8 + length]).decode("utf-8"), pos + 8 + length

    def _value(self, kind: int, pos: int) -> tuple[Any, int]:
        if kind in _SCALARS:
            fmt, size = _SCALARS[kind]
            return struct.unpack_from(fmt, self._map, pos)[0], pos + size
        if kind == _STRING:
            return self._string(pos)
        if kind != _ARRAY:
            raise GGUFFormatError(f"{self.path} has a metadata value of unknown type {kind}")
        item, count = struct.unpack_from("<IQ", self._map, pos)
        pos += 12
        if item in _NUMPY:
            dtype = np.dtype(_NUMPY[item])
            array = np.frombuffer(self._map, dtype, count, pos)
            return array, pos + count * dtype.itemsize
        if item == _STRING:
            start, buffer, length_at = pos, self._map, _U64.unpack_from
            for _ in range(count):  # skip over the strings; StringArray decodes them when asked
                pos += 8 + length_at(buffer, pos)[0]
            return StringArray(self._map, start, count), pos
        values = []
        for _ in range(count):  # arrays of arrays: rare, read whole
            value, pos = self._value(item, pos)
            values.append(value)
        return values, pos

    # --- access ----------------------------------------------------------------------------

    def data(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored, a read-only uint8 view ``[rows, bytes per row]`` (for a
        float type, viewed as that float: ``[*shape]``)."""
        info = self.tensors[name]
        raw = np.frombuffer(self._map, np.uint8, info.nbytes, info.offset)
        float_dtype = _FLOAT_TYPES.get(info.type)
        if float_dtype is not None:
            return raw.view(float_dtype).reshape(info.shape)
        return raw.reshape(-1, info.nbytes // max(1, _rows(info.shape)))

    @functools.cached_property
    def identity_key(self) -> str:
        return file_identity(self.path)

    def release(self, name: str) -> None:
        """Let go of the pages the tensor's bytes occupy in this process (they stay in the page
        cache): a mapped file's pages count as the process's memory once read, and a runtime
        that copies each tensor away needs the file's pages only while it reads them."""
        info = self.tensors[name]
        start = info.offset // mmap.PAGESIZE * mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, start, info.offset + info.nbytes - start)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def open_gguf(path: str | Path) -> GGUFFile:
    """``GGUFFile(path)``, parsed once per process while the file stays the same: the memory
    check, the lazy model and the tokenizer all read the header, and parsing a 151k-token
    vocabulary's header costs 0.5 s each time."""
    real = Path(path).resolve()
    stat = real.stat()
    return _parsed(str(real), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino)


@functools.lru_cache(maxsize=4)
def _parsed(real: str, size: int, mtime_ns: int, ctime_ns: int, inode: int) -> GGUFFile:
    return GGUFFile(real)


def file_identity(path: str | Path) -> str:
    """A key that changes with the file, read without parsing it: its real path, size and
    modification time, and a hash of its first 4 MiB (the header: metadata, tensor table) and
    its last MiB. Hashing every byte would cost a second per GB on every run."""
    import hashlib

    real = Path(path).resolve()
    stat = real.stat()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{real};{stat.st_size};{stat.st_mtime_ns};".encode())
    with open(real, "rb") as handle:
        h.update(handle.read(4 << 20))
        handle.seek(max(0, stat.st_size - (1 << 20)))
        h.update(handle.read())
    return h.hexdigest()


_FLOAT_TYPES = {0: np.float32, 1: np.float16, 30: np.dtype("<u2")}  # F32, F16, BF16 (raw 16-bit words)


def _rows(shape: tuple[int, ...]) -> int:
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows


def _tensor_nbytes(shape: tuple[int, ...], kind: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise GGUFFormatError(f"tensor type {kind} is unknown to the installed gguf package") from None
    elements = 1
    for d in shape:
        elements *= d
    if shape and shape[-1] % block:
        raise GGUFFormatError(f"a tensor of type {GGMLQuantizationType(kind).name} has rows of {shape[-1]} "
                              f"values, not a multiple of its block of {block}")
    return elements // block * size
