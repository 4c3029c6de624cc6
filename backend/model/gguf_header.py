"""Validate a GGUF file's structure before anything trusts it: one pass over the header that checks
every count, length, type, dimension and offset against the file's size and against sane limits.

GGUF (llama.cpp's format, little-endian)::

    "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count     x  key: string | value_type u32 | value
    tensor_count x  name: string | n_dims u32 | dims u64[n_dims] (ne0 first) | ggml_type u32 | offset u64
    padding to general.alignment (default 32) | data: tensor i at data_start + offset_i

    string = length u64 + UTF-8 bytes            array = item_type u32 + count u64 + items

gguf-py's reader trusts these fields (a count of 2**63 ends in IndexError, nested arrays recurse
without bound, each array item costs a numpy view), so the importer reads the header here instead:
a field is checked before it sizes anything, numeric arrays stay views of the mapped file, and
tensor data must follow llama.cpp's own layout rule (in order, each at the aligned end of the one
before), which llama.cpp enforces on load too.
"""
from __future__ import annotations

import mmap
import os
import pathlib
import struct
from dataclasses import dataclass, field

import numpy as np

from common.param_codec import INT64_MAX


class GGUFError(ValueError):
    """The file is not a GGUF this importer supports; the message says what and why."""


@dataclass(frozen=True)
class Limits:
    """Far above any real model (256k-token vocabularies, ~2k tensors) and far below what would
    exhaust memory; each is named in the error when a file passes it."""
    max_tensors: int = 1 << 16
    max_kv: int = 1 << 16
    max_key_bytes: int = 1 << 16
    max_name_bytes: int = 256                  # llama.cpp allows 63
    max_string_bytes: int = 64 << 20           # one string (chat templates are ~10 KB)
    max_array_items: int = 1 << 24             # one array
    max_objects: int = 1 << 22                 # strings + nested arrays kept as Python objects
    max_text_bytes: int = 512 << 20            # all strings together
    max_depth: int = 4                         # arrays inside arrays
    max_dims: int = 4                          # GGML_MAX_DIMS


LIMITS = Limits()
VERSIONS = (2, 3)
STRING, ARRAY = 8, 9
# value type -> (struct / numpy little-endian format, size, name)
SCALARS = {0: ("<u1", 1, "uint8"), 1: ("<i1", 1, "int8"), 2: ("<u2", 2, "uint16"), 3: ("<i2", 2, "int16"),
           4: ("<u4", 4, "uint32"), 5: ("<i4", 4, "int32"), 6: ("<f4", 4, "float32"), 7: ("<u1", 1, "bool"),
           10: ("<u8", 8, "uint64"), 11: ("<i8", 8, "int64"), 12: ("<f8", 8, "float64")}
TYPE_NAMES = {**{k: v[2] for k, v in SCALARS.items()}, STRING: "string", ARRAY: "array"}


@dataclass(frozen=True)
class TensorInfo:
    index: int
    name: str
    ggml_type: int                    # a gguf.GGMLQuantizationType value with known block sizes
    dims: tuple[int, ...]             # GGUF order: ne0 (the contiguous axis) first
    offset: int                       # absolute offset of the data in the file
    nbytes: int


@dataclass
class GGUFHeader:
    path: pathlib.Path
    size: int
    version: int
    alignment: int
    data_offset: int
    metadata: dict[str, tuple[int, object]]   # key -> (value type, value); numeric arrays: np views
    tensors: list[TensorInfo]
    buffer: mmap.mmap = field(repr=False)     # read-only map of the file, for tensor data views


class _Reader:
    def __init__(self, path: pathlib.Path, buf, limits: Limits) -> None:
        self.path, self.buf, self.size, self.limits = path, buf, len(buf), limits
        self.pos = 0
        self.objects = self.text_bytes = 0

    def fail(self, message: str) -> GGUFError:
        return GGUFError(f"{self.path}: {message}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"{what} at offset {self.pos} needs {n} bytes, but the file ends at {self.size}")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str, limit: int) -> str:
        n = self.unpack("<Q", f"{what}: length")
        if n > limit:
            raise self.fail(f"{what}: string of {n} bytes is longer than the limit of {limit}")
        self.need(n, f"{what}: string of {n} bytes")
        self.text_bytes += n
        if self.text_bytes > self.limits.max_text_bytes:
            raise self.fail(f"{what}: strings add up to more than {self.limits.max_text_bytes} bytes")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what}: string is not valid UTF-8") from None

    def count_object(self, what: str, n: int) -> None:
        self.objects += n
        if self.objects > self.limits.max_objects:
            raise self.fail(f"{what}: more than {self.limits.max_objects} strings and arrays in the metadata")

    def value(self, vtype: int, what: str, depth: int):
        if vtype in SCALARS:
            fmt, size, name = SCALARS[vtype]
            self.need(size, f"{what}: {name} value")
            v = np.frombuffer(self.buf, dtype=fmt, count=1, offset=self.pos)[0].item()
            self.pos += size
            return bool(v) if vtype == 7 else v
        if vtype == STRING:
            self.count_object(what, 1)
            return self.string(what, self.limits.max_string_bytes)
        if vtype != ARRAY:
            raise self.fail(f"{what}: unknown value type {vtype}")
        self.count_object(what, 1)
        if depth >= self.limits.max_depth:
            raise self.fail(f"{what}: arrays nested deeper than {self.limits.max_depth}")
        item_type = self.unpack("<I", f"{what}: array item type")
        n = self.unpack("<Q", f"{what}: array length")
        if item_type in SCALARS:
            item_size = SCALARS[item_type][1]
        elif item_type in (STRING, ARRAY):
            item_size = 8 if item_type == STRING else 12          # the smallest such item
        else:
            raise self.fail(f"{what}: array of unknown value type {item_type}")
        if n > self.limits.max_array_items:
            raise self.fail(f"{what}: array of {n} items is longer than the limit of {self.limits.max_array_items}")
        self.need(n * item_size, f"{what}: array of {n} {TYPE_NAMES[item_type]}")
        if item_type in SCALARS:              # a view of the mapped file, nothing copied
            fmt, size, _ = SCALARS[item_type]
            arr = np.frombuffer(self.buf, dtype=fmt, count=n, offset=self.pos)
            self.pos += n * size
            return (item_type, arr.astype(bool) if item_type == 7 else arr)
        return (item_type, [self.value(item_type, f"{what} item {i}", depth + 1) for i in range(n)])

    def metadata(self, count: int) -> dict[str, tuple[int, object]]:
        out: dict[str, tuple[int, object]] = {}
        for i in range(count):
            key = self.string(f"metadata entry {i}: key", self.limits.max_key_bytes)
            what = f"metadata {key!r}"
            if key in out:
                raise self.fail(f"{what} appears twice")
            vtype = self.unpack("<I", f"{what}: value type")
            out[key] = (vtype, self.value(vtype, what, 0))
        return out

    def tensor_info(self, i: int) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string(f"tensor {i}: name", self.limits.max_name_bytes)
        what = f"tensor {i} {name!r}"
        n_dims = self.unpack("<I", f"{what}: dimension count")
        if not 1 <= n_dims <= self.limits.max_dims:
            raise self.fail(f"{what}: {n_dims} dimensions (1 to {self.limits.max_dims} supported)")
        dims = tuple(self.unpack("<Q", f"{what}: dimension {d}") for d in range(n_dims))
        n = 1
        for d, size in enumerate(dims):
            if not 1 <= size <= INT64_MAX:
                raise self.fail(f"{what}: dimension {d} has size {size}")
            n *= size
            if n > INT64_MAX:
                raise self.fail(f"{what}: dimensions {dims} hold more than 2**63 values")
        ggml_type = self.unpack("<I", f"{what}: type")
        offset = self.unpack("<Q", f"{what}: data offset")
        return name, dims, ggml_type, offset


def _alignment(r: _Reader, metadata: dict) -> int:
    vtype, value = metadata.get("general.alignment", (4, 32))
    if vtype != 4 or not value or value & (value - 1):
        raise r.fail(f"general.alignment must be a uint32 power of two (got {TYPE_NAMES.get(vtype, vtype)} {value!r})")
    return value


def _tensors(r: _Reader, infos, data_offset: int, alignment: int) -> list[TensorInfo]:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    out, names, expected, prev = [], set(), 0, None
    for i, (name, dims, ggml_type, offset) in enumerate(infos):
        what = f"tensor {i} {name!r}"
        if name in names:
            raise r.fail(f"{what} appears twice")
        names.add(name)
        try:
            qtype = GGMLQuantizationType(ggml_type)
        except ValueError:
            raise r.fail(f"{what}: unknown ggml type {ggml_type}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise r.fail(f"{what}: rows of {dims[0]} values are not whole {block}-value {qtype.name} blocks")
        nbytes = int(np.prod(dims, dtype=object)) // block * type_size
        if offset % alignment:
            raise r.fail(f"{what}: data offset {offset} is not a multiple of the alignment {alignment}")
        if offset != expected:
            after = f"after tensor {prev} (which ends at {expected})" if prev is not None else "at the start of the data"
            raise r.fail(f"{what}: data at offset {offset} does not follow {after}: tensors must be stored "
                         "in order without gaps or overlaps")
        start = data_offset + offset
        if nbytes > r.size - start:
            raise r.fail(f"{what}: data at offset {start} ({nbytes} bytes) runs past the end of the file "
                         f"(size {r.size})")
        out.append(TensorInfo(i, name, int(qtype), dims, start, nbytes))
        expected = -(-(offset + nbytes) // alignment) * alignment
        prev = f"{i} {name!r}"
    return out


def read_header(path: str | os.PathLike, limits: Limits = LIMITS) -> GGUFHeader:
    """Parse and validate ``path``'s header; GGUFError naming the first bad field. OSError (missing
    file, no permission) passes through."""
    path = pathlib.Path(path)
    if path.exists() and not path.is_file():         # a FIFO would block open(); a directory fails it
        raise GGUFError(f"{path}: not a regular file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (no GGUF magic at the start)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    r = _Reader(path, buf, limits)
    r.pos = 4
    version = r.unpack("<I", "version")
    if version not in VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        hint = " (a big-endian file: not supported)" if swapped in VERSIONS else ""
        raise r.fail(f"GGUF version {version} is not supported (only {VERSIONS[0]} and {VERSIONS[1]}){hint}")
    n_tensors = r.unpack("<Q", "tensor count")
    n_kv = r.unpack("<Q", "metadata count")
    if n_tensors > limits.max_tensors:
        raise r.fail(f"tensor count {n_tensors} is over the limit of {limits.max_tensors}")
    if n_kv > limits.max_kv:
        raise r.fail(f"metadata count {n_kv} is over the limit of {limits.max_kv}")
    # Each entry takes at least 12 (metadata) / 24 (tensor) bytes: a count the file cannot hold
    # fails here, before any loop runs.
    if n_kv * 12 + n_tensors * 24 > r.size - r.pos:
        raise r.fail(f"{n_kv} metadata entries and {n_tensors} tensors cannot fit in a file of {r.size} bytes")
    metadata = r.metadata(n_kv)
    infos = [r.tensor_info(i) for i in range(n_tensors)]
    alignment = _alignment(r, metadata)
    data_offset = -(-r.pos // alignment) * alignment
    if n_tensors and data_offset > r.size:
        raise r.fail(f"tensor data would start at offset {data_offset}, past the end of the file (size {r.size})")
    tensors = _tensors(r, infos, data_offset, alignment)
    return GGUFHeader(path, r.size, version, alignment, data_offset, metadata, tensors, buf)
