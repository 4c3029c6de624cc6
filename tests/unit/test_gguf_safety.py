"""import-gguf against bad files and bad --out targets: attacks that used to hurt and now fail.

- Files that made gguf-py's reader raise IndexError / RecursionError get one GGUFError line naming
  the field; the limits (array length, strings, nesting) hold before anything is allocated.
- On valid files the validating reader returns what gguf-py's reader returns.
- ``--out`` into a non-empty foreign directory (``.`` included) leaves it intact; into a previous
  import replaces that import's files only.
- The CLI prints one line and exits 2, within 1 GiB (RLIMIT_DATA, and the child's peak RSS), no
  traceback; ``serve`` does the same when the default model cannot be imported.
"""
from __future__ import annotations

import json
import os
import pathlib
import struct
import subprocess
import sys

import numpy as np
import pytest

from backend.model.gguf_header import GGUFError, Limits, read_header
from backend.model.gguf_import import import_gguf
from backend.model.gguf_output import MANIFEST
from backend.model.gguf_reader import GGUFFile
from tests.unit.gguf_micro import field_map, write_micro

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def micro(tmp_path) -> pathlib.Path:
    return write_micro(tmp_path / "m.gguf")


def _field(path: pathlib.Path, what: str) -> tuple[int, int]:
    (hit,) = [(o, s) for o, s, w in field_map(path)[0] if w == what]
    return hit


def _patched(path: pathlib.Path, what: str, value: int, name: str = "x.gguf") -> pathlib.Path:
    offset, size = _field(path, what)
    raw = bytearray(path.read_bytes())
    raw[offset:offset + size] = value.to_bytes(size, "little")
    out = path.with_name(name)
    out.write_bytes(raw)
    return out


def _nested(path: pathlib.Path, depth: int) -> pathlib.Path:
    raw = path.read_bytes()
    n_kv = struct.unpack_from("<Q", raw, 16)[0]
    # The key is padded so the entry is a whole number of 32-byte alignment units: the tensor
    # data stays where its offsets say.
    key = b"x" + b"_" * (-(8 + 1 + 4 + 12 * depth + 12) % 32)
    entry = struct.pack("<Q", len(key)) + key + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 0, 0)
    out = path.with_name("nested.gguf")
    out.write_bytes(raw[:16] + struct.pack("<Q", n_kv + 1) + entry + raw[24:])
    return out


def test_files_that_broke_gguf_py_are_one_named_error(micro):
    from gguf import GGUFReader

    truncated = micro.with_name("t.gguf")
    truncated.write_bytes(micro.read_bytes()[:1000])
    cases = [(truncated, IndexError, r"at offset \d+ needs \d+ bytes, but the file ends at 1000"),
             (_patched(micro, "tensor count", 1 << 40), IndexError, "tensor count 1099511627776 is over the limit of 65536"),
             (_nested(micro, 100_000), RecursionError, "'x_*' item 0 item 0 item 0 item 0: arrays nested deeper than 4")]
    for path, theirs, ours in cases:
        with pytest.raises(theirs):
            GGUFReader(str(path))
        with pytest.raises(GGUFError, match=ours):
            read_header(path)


def test_tensor_data_past_the_end_names_the_tensor(micro):
    raw = micro.read_bytes()
    cut = micro.with_name("cut.gguf")
    cut.write_bytes(raw[:-100])
    last = read_header(micro).tensors[-1]
    with pytest.raises(GGUFError, match=rf"^{cut}: tensor 10 'blk.0.ffn_down.weight': data at offset {last.offset} "
                                        rf"\({last.nbytes} bytes\) runs past the end of the file \(size {len(raw) - 100}\)$"):
        import_gguf(cut, cut.with_name("out"), progress=None)


@pytest.mark.parametrize("what, value, message", [
    ("version", 3 << 24, "GGUF version 50331648 is not supported .* big-endian"),
    ("tokenizer.ggml.tokens array length", 1 << 62, "array of 4611686018427387904 items is longer than the limit"),
    ("tokenizer.ggml.tokens item 1 length", (1 << 64) - 1, "string of 18446744073709551615 bytes is longer than the limit"),
    ("blk.0.attn_q.weight dimension count", 7, "tensor 4 'blk.0.attn_q.weight': 7 dimensions"),
    ("blk.0.attn_q.weight dimension 1", 0, "dimension 1 has size 0"),
    ("blk.0.attn_q.weight dimension 1", 1 << 62, "hold more than 2\\*\\*63 values"),
    ("blk.0.attn_q.weight type", 4, "unknown ggml type 4"),
    ("blk.0.attn_q.weight dimension 0", 33, "rows of 33 values are not whole 32-value Q8_0 blocks"),
    ("blk.0.attn_q.weight offset", 1 << 63, "data at offset 9223372036854775808 does not follow after tensor 3"),
    ("blk.0.attn_q.weight offset", 3, "data offset 3 is not a multiple of the alignment 32"),
    ("llama.block_count value type", 13, "metadata 'llama.block_count': unknown value type 13"),
])
def test_each_structural_field_is_checked(micro, what, value, message):
    with pytest.raises(GGUFError, match=message):
        read_header(_patched(micro, what, value))


def test_limits_hold_before_allocation(micro):
    with pytest.raises(GGUFError, match="'tokenizer.ggml.tokens': array of 12 items is longer than the limit of 4"):
        read_header(micro, Limits(max_array_items=4))
    with pytest.raises(GGUFError, match="more than 10 strings and arrays in the metadata"):
        read_header(micro, Limits(max_objects=10))
    with pytest.raises(GGUFError, match="strings add up to more than 100 bytes"):
        read_header(micro, Limits(max_text_bytes=100))
    read_header(_nested(micro, 3))
    with pytest.raises(GGUFError, match="arrays nested deeper than 4"):
        read_header(_nested(micro, 4))


@pytest.mark.parametrize("preset", ["micro", "tiny-qwen2"])
def test_valid_files_read_as_gguf_py_reads_them(tmp_path, preset):
    from gguf import GGUFReader

    if preset == "micro":
        path = write_micro(tmp_path / "m.gguf")
    else:
        from tests.conftest import model_dir
        from tests.unit.test_gguf_import import write_gguf
        write_gguf(model_dir(preset), tmp_path / "m.gguf", qtype="Q4_1")
        path = tmp_path / "m.gguf"
    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    assert ours.header.metadata.keys() == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            assert ours.get(key) == field.contents(), key
    assert [t.name for t in ours.header.tensors] == [t.name for t in theirs.tensors]
    for info, t in zip(ours.header.tensors, theirs.tensors):
        data = ours._data(info)
        assert data.shape == t.data.shape and data.dtype == t.data.dtype, t.name
        np.testing.assert_array_equal(data.view(np.uint8), t.data.view(np.uint8), err_msg=t.name)


@pytest.mark.parametrize("meta, message", [
    ({"llama.embedding_length": ("UINT32", 64)}, r"tensor token_embd.weight has shape \(12, 32\), the metadata implies \(12, 64\)"),
    ({"llama.block_count": ("UINT32", 2)}, "9 tensors are missing, e.g. model.layers.1.input_layernorm.weight"),
    ({"llama.attention.head_count": ("STRING", "2")}, "metadata llama.attention.head_count has type string, expected an integer"),
    ({"llama.attention.head_count_kv": ("UINT32", 3)}, r"head_count_kv = 3 is out of range \(1 to 2\)"),
    ({"llama.rope.freq_base": ("FLOAT32", float("nan"))}, "rope.freq_base = nan is out of range"),
    ({"tokenizer.ggml.merges": ("ARRAY", ["a b", "zz q"])}, "the tokenizer cannot be rebuilt from its metadata"),
    ({"tokenizer.ggml.merges": ("ARRAY", ["a b", "ab"])}, "merge 1 is not two tokens separated by a space"),
    ({"tokenizer.ggml.token_type": ("ARRAY", [1, 1])}, "2 token types for 12 tokens"),
])
def test_metadata_is_checked_against_the_tensors(tmp_path, meta, message):
    path = write_micro(tmp_path / "m.gguf", meta)
    with pytest.raises(GGUFError, match=message):
        import_gguf(path, tmp_path / "out", progress=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]       # no out, no staging left


def test_out_into_a_foreign_directory_leaves_it_intact(micro, tmp_path):
    foreign = tmp_path / "mine"
    (foreign / "sub").mkdir(parents=True)
    (foreign / "notes.txt").write_text("keep me")
    (foreign / "config.json").write_text("{}")
    (foreign / "sub" / "data.bin").write_bytes(b"\0" * 10)
    before = sorted((p.relative_to(foreign), p.read_bytes() if p.is_file() else None) for p in foreign.rglob("*"))
    with pytest.raises(GGUFError, match="is not empty and is not a previous import .* nothing was written"):
        import_gguf(micro, foreign, progress=None)
    # A manifest an import did not write (here: naming a file outside the directory) is not one.
    (foreign / MANIFEST).write_text(json.dumps({"written_by": "triton-llm import-gguf", "files": ["../m.gguf"]}))
    with pytest.raises(GGUFError, match="not a previous import"):
        import_gguf(micro, foreign, progress=None)
    (foreign / MANIFEST).unlink()
    assert sorted((p.relative_to(foreign), p.read_bytes() if p.is_file() else None) for p in foreign.rglob("*")) == before
    assert micro.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "mine"]
    (tmp_path / "afile").write_text("x")
    with pytest.raises(GGUFError, match="exists and is not a directory"):
        import_gguf(micro, tmp_path / "afile", progress=None)


def test_out_into_a_previous_import_replaces_only_its_files(tmp_path):
    from tests.conftest import model_dir
    from tests.unit.test_gguf_import import write_gguf

    out = tmp_path / "model"
    import_gguf(write_micro(tmp_path / "a.gguf"), out, progress=None)
    first = json.loads((out / MANIFEST).read_text())["files"]
    (out / "README.md").write_text("the user's own notes")
    (out / "model.safetensors.index.json").write_text("{}")   # stale, and not the import's: kept
    write_gguf(model_dir("tiny"), tmp_path / "b.gguf")
    import_gguf(tmp_path / "b.gguf", out, progress=None)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["files"] == first and manifest["source"] == "b.gguf"
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 256        # the new model
    assert (out / "README.md").read_text() == "the user's own notes"
    assert (out / "model.safetensors.index.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "model"]


def test_out_dot(micro, tmp_path, monkeypatch, capsys):
    from triton_llm.cli import main

    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    monkeypatch.chdir(work)
    assert main(["import-gguf", str(micro), "--out", "."]) == 2
    err = capsys.readouterr().err
    assert err.startswith("import-gguf: --out ") and "is not empty and is not a previous import" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "work"]
    assert [p.name for p in work.iterdir()] == ["keep.txt"] and (work / "keep.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    assert main(["import-gguf", str(micro), "--out", "."]) == 0
    assert (empty / "config.json").is_file() and os.getcwd() == str(empty)   # imported in place


# The CLI's own entry point, reporting the process's peak RSS (KiB) on stdout when it returns.
_CLI = ("import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_DATA, (1 << 30, resource.getrlimit(resource.RLIMIT_DATA)[1]))\n"
        "from triton_llm.cli import main\n"
        "rc = main(sys.argv[1:])\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
        "sys.exit(rc)\n")


def test_cli_prints_one_line_within_limits(micro, tmp_path):
    cut = micro.with_name("cut.gguf")
    cut.write_bytes(micro.read_bytes()[:300])
    files = [cut, _patched(micro, "tensor count", 1 << 40, "count.gguf"), _nested(micro, 100_000),
             _patched(micro, "blk.0.attn_v.weight dimension 1", 1 << 30, "dims.gguf")]
    for path in files:
        # 60 s: the interpreter and torch start first on a shared 2-core host; the import itself
        # is bounded by test_gguf_fuzz's 10 s alarm.
        proc = subprocess.run([sys.executable, "-c", _CLI, "import-gguf", str(path), "--out", str(tmp_path / "out")],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        err = proc.stderr
        assert proc.returncode == 2, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"import-gguf: {path}: "), err
        # Memory: RLIMIT_DATA caps the process's allocations at 1 GiB, so an import that wanted
        # more would die of a MemoryError's traceback, which the checks above refuse. (Peak RSS is
        # no measure: it counts the shared libraries' pages, 1.0-1.4 GB with torch mapped.)
    assert not (tmp_path / "out").exists()


def test_serve_reports_a_bad_default_model_in_one_line(tmp_path, monkeypatch, capsys):
    from backend import default_model
    from triton_llm.cli import main

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / pathlib.Path(default_model.GGUF_MEMBER).name).write_bytes(b"GGUF" + b"\xff" * 20)
    monkeypatch.setattr(default_model, "CACHE_DIR", cache)
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_DIR", tmp_path / "default")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("serve: the default model could not be set up: ") and "GGUF version" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "default").exists()
