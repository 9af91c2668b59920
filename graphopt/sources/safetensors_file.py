"""A Hugging Face checkpoint directory's ``*.safetensors`` files before anything is built from
them, without importing torch: each file's header (an 8-byte length, then a JSON table of
every tensor's dtype, shape and byte range), the directory's identity for cache keys, and the
memory its weights take once a runtime holds them."""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

_HEADER_LIMIT = 100 << 20  # safetensors' own bound on the JSON header

# bytes per element of each dtype safetensors names
ELEMENT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                 "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class SafetensorsFormatError(ValueError):
    """A file that is not a readable safetensors file (its message says which and why)."""


@dataclass(frozen=True)
class TensorEntry:
    dtype: str  # as the file names it (BF16, F32, ...)
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    stop: int


def read_header(path: Path) -> dict[str, TensorEntry]:
    """{tensor name: where and what it is} from ``path``'s header (a few kB read)."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise SafetensorsFormatError(f"{path} is shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > min(_HEADER_LIMIT, size - 8):
            raise SafetensorsFormatError(f"{path} declares a {length}-byte header: not a safetensors file")
        try:
            header = json.loads(handle.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SafetensorsFormatError(f"{path} has no valid JSON header ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsFormatError(f"{path}'s header is not a table of tensors")
    base = 8 + length
    tensors: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            entry = TensorEntry(str(info["dtype"]), tuple(int(d) for d in info["shape"]), base + int(begin),
                                base + int(end))
        except (KeyError, TypeError, ValueError):
            raise SafetensorsFormatError(f"{path}: the header entry of {name} is malformed") from None
        if entry.stop > size or entry.start > entry.stop:
            raise SafetensorsFormatError(f"{path}: {name}'s bytes lie past the end of the file (a download cut short?)")
        tensors[name] = entry
    return tensors


def checkpoint_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def folder_identity(folder: Path, files: list[Path]) -> str:
    """A key that changes with the checkpoint: its config.json's bytes and each weights file's
    identity (path, size, modification time, its first 4 MiB and last MiB), read without
    hashing every byte."""
    from graphopt.sources.gguf_file import file_identity

    h = hashlib.blake2b(digest_size=16)
    h.update((folder / "config.json").read_bytes())
    for f in files:
        h.update(f"{f.name}={file_identity(f)};".encode())
    return h.hexdigest()


def float32_bytes(files: list[Path]) -> int:
    """The weights' bytes once a runtime holds each floating tensor as float32 (what the ONNX
    Runtime CPU target computes in)."""
    total = 0
    for f in files:
        for entry in read_header(f).values():
            count = (entry.stop - entry.start) // ELEMENT_BYTES.get(entry.dtype, 1)
            total += count * 4 if entry.dtype.startswith(("F", "BF")) else entry.stop - entry.start
    return total
