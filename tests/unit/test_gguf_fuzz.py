"""Hypothesis fuzzing of GGUF headers: about 600 corrupt or odd files made from the micro GGUF
(tests/unit/gguf_micro.py) by byte flips, structural fields set to edge values (lengths, counts,
types, dimensions, offsets), truncation, arrays nested up to 10^5 deep, duplicated entries, and
metadata of the wrong type or range written by gguf-py itself.

Each file goes through ``import_gguf`` in this process: it either imports (then the directory is a
marked import) or raises GGUFError, nothing else; each call runs under a 10 s alarm (a hang fails
the test), and the whole module runs with RLIMIT_DATA at what the process held + 1 GiB (an
allocation past it fails the test with MemoryError). Derandomized, so every run makes the same
files. tests/unit/test_gguf_safety.py runs a sample through the CLI for the no-traceback check.
"""
from __future__ import annotations

import pathlib
import resource
import shutil
import signal
import struct
import tempfile

import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from backend.model.gguf_header import GGUFError
from backend.model.gguf_import import import_gguf
from backend.model.gguf_output import MANIFEST
from tests.unit.gguf_micro import field_map, metadata, write_micro

SECONDS = 10
MEMORY = 1 << 30
FUZZ = dict(deadline=None, derandomize=True, database=None, print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Hang(BaseException):
    """Raised by the alarm; a BaseException so no ``except Exception`` in the importer hides it."""


def _vm_data() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))


@pytest.fixture(scope="module")
def seed():
    work = pathlib.Path(tempfile.mkdtemp(prefix="gguf-fuzz-"))
    path = write_micro(work / "seed.gguf")
    import_gguf(path, work / "warm", progress=None)           # imports done once, outside the limits
    fields, data_offset = field_map(path)
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = _vm_data() + MEMORY
    resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        yield path.read_bytes(), fields, data_offset, work
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        shutil.rmtree(work, ignore_errors=True)


def _alarm(signum, frame):
    raise Hang(f"an import ran past {SECONDS} s")


def check_import(data: bytes, work: pathlib.Path) -> None:
    """Import ``data``: success or GGUFError, within SECONDS; anything else fails the example."""
    case = pathlib.Path(tempfile.mkdtemp(dir=work))
    try:
        (case / "x.gguf").write_bytes(data)
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, SECONDS)
        try:
            import_gguf(case / "x.gguf", case / "out", progress=None)
        except GGUFError as exc:
            assert "\n" not in str(exc) and str(exc).startswith(str(case / "x.gguf")), str(exc)
            assert not (case / "out").exists()
        else:
            assert (case / "out" / MANIFEST).is_file() and (case / "out" / "config.json").is_file()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    finally:
        shutil.rmtree(case, ignore_errors=True)


def _edge_values(size: int, original: int, file_size: int) -> list[int]:
    top = (1 << (8 * size)) - 1
    values = {0, 1, 2, 3, 4, 7, 8, 9, 12, 13, 31, 32, 33, 255, 256, 4095, 65535, (1 << 31) - 1, 1 << 31,
              (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63, top, file_size - 1, file_size, file_size + 1,
              original - 1, original + 1, original * 2, original * 1000}
    return sorted(v for v in values if 0 <= v <= top)


@settings(max_examples=200, **FUZZ)
@given(st.data())
def test_structural_fields_set_to_edge_values(seed, data):
    raw, fields, _, work = seed
    picks = data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3))
    buf = bytearray(raw)
    for offset, size, _what in picks:
        original = int.from_bytes(raw[offset:offset + size], "little")
        value = data.draw(st.one_of(st.sampled_from(_edge_values(size, original, len(raw))),
                                    st.integers(0, (1 << (8 * size)) - 1)))
        buf[offset:offset + size] = value.to_bytes(size, "little")
    check_import(bytes(buf), work)


@settings(max_examples=150, **FUZZ)
@given(st.data())
def test_header_bytes_flipped(seed, data):
    raw, _, data_offset, work = seed
    edits = data.draw(st.lists(st.tuples(st.integers(0, data_offset - 1), st.integers(0, 255)),
                               min_size=1, max_size=8))
    buf = bytearray(raw)
    for pos, byte in edits:
        buf[pos] = byte
    check_import(bytes(buf), work)


@settings(max_examples=80, **FUZZ)
@given(st.data())
def test_truncated(seed, data):
    raw, _, data_offset, work = seed
    # Mostly inside the header, where every field can be cut; some inside the tensor data.
    end = data.draw(st.one_of(st.integers(0, data_offset), st.integers(0, len(raw) - 1)))
    check_import(raw[:end], work)


def _with_entry(raw: bytes, entry: bytes) -> bytes:
    """``raw`` with one more metadata entry first in the list (the count raised to match)."""
    n_kv = struct.unpack_from("<Q", raw, 16)[0]
    return raw[:16] + struct.pack("<Q", n_kv + 1) + entry + raw[24:]


def _key(name: bytes) -> bytes:
    return struct.pack("<Q", len(name)) + name


@settings(max_examples=40, **FUZZ)
@given(depth=st.one_of(st.integers(1, 12), st.sampled_from([100, 1000, 100_000])),
       item_type=st.integers(0, 14), count=st.sampled_from([0, 1, 3, 1 << 20, (1 << 64) - 1]),
       cut=st.booleans())
def test_nested_arrays(seed, depth, item_type, count, cut):
    raw, _, _, work = seed
    entry = _key(b"fuzz.nested") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * (depth - 1)
    entry += struct.pack("<IQ", item_type, count) + b"\x01" * 16
    data = _with_entry(raw, entry)
    check_import(data[: 24 + len(entry) // 2] if cut else data, work)


@settings(max_examples=30, **FUZZ)
@given(st.data())
def test_duplicated_and_huge_entries(seed, data):
    raw, fields, _, work = seed
    kind = data.draw(st.sampled_from(["dup-key", "long-key", "long-string", "many-strings"]))
    if kind == "dup-key":                 # general.architecture a second time
        entry = _key(b"general.architecture") + struct.pack("<I", 8) + _key(b"llama")
    elif kind == "long-key":
        entry = _key(b"k" * data.draw(st.sampled_from([300, 70_000])))
    elif kind == "long-string":
        entry = _key(b"fuzz.s") + struct.pack("<IQ", 8, data.draw(st.sampled_from([1 << 27, 1 << 40, (1 << 64) - 1])))
    else:                                 # an array of empty strings: 8 bytes each
        n = data.draw(st.sampled_from([5, 1 << 16, 1 << 23, 1 << 30]))
        entry = _key(b"fuzz.a") + struct.pack("<IIQ", 9, 8, n) + b"\0" * min(n, 1 << 17) * 8
    check_import(_with_entry(raw, entry), work)


_KEYS = sorted(metadata())
_VALUES = st.one_of(
    st.tuples(st.just("UINT32"), st.one_of(st.integers(0, 70), st.integers(0, (1 << 32) - 1))),
    st.tuples(st.just("INT32"), st.integers(-(1 << 31), (1 << 31) - 1)),
    st.tuples(st.just("UINT64"), st.integers(0, (1 << 64) - 1)),
    st.tuples(st.just("FLOAT32"), st.floats(width=32)),
    st.tuples(st.just("BOOL"), st.booleans()),
    st.tuples(st.just("STRING"), st.sampled_from(["", "llama", "qwen2", "gpt2", "llama-bpe", "none", "linear", "yarn"])),
    st.tuples(st.just("STRING"), st.text(max_size=20)),
    st.tuples(st.just("ARRAY"), st.lists(st.integers(-5, 70), min_size=1, max_size=20)),
    st.tuples(st.just("ARRAY"), st.lists(st.text(max_size=6), min_size=1, max_size=20)),
    st.none(),
)


@settings(max_examples=100, **FUZZ)
@given(changes=st.dictionaries(st.sampled_from(_KEYS), _VALUES, min_size=1, max_size=3))
def test_metadata_of_wrong_type_or_range(seed, changes):
    _, _, _, work = seed
    path = pathlib.Path(tempfile.mkdtemp(dir=work)) / "m.gguf"
    try:
        write_micro(path, changes)
    except Exception:                     # gguf-py refused to write it (a value its type cannot hold)
        reject()
    try:
        check_import(path.read_bytes(), work)
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)
