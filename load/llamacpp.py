"""llama.cpp as a peer: build ``llama-server`` once, convert a checkpoint to GGUF, run the server.

Everything is cached under ``build/peers/`` (never part of ``make test``)::

    build/peers/llama_cpp_python-<ver>/vendor/llama.cpp   the source, from the llama-cpp-python sdist
    build/peers/llama-build/bin/llama-server              Release build of the server target only
    build/peers/gguf/<model>-<f32|bf16>.gguf              converted checkpoints
    build/peers/llama-build/bin/llama-quantize            the quantizer (built on first quantized run)
    build/peers/gguf/<model>-<q8_0|q4_0>.gguf             quantized from the f32 GGUF
    build/peers/gguf/<model>-<q8_0|q4_0>-ours/            that file imported --keep-quantized (ours)

Why the sdist: PyPI is the one source registry reachable here, and llama-cpp-python vendors a
whole llama.cpp tree (server, ggml CPU backend, ``convert_hf_to_gguf.py`` and its ``gguf-py``).
The build needs cmake and a C++ compiler; :func:`ensure_toolchain` installs them with apt-get when
they are missing and we are root (otherwise it says what to install).

Conversion: our checkpoints lack ``architectures`` in config.json (transformers does not need it),
so a staging directory adds it; and the project's byte-level BPE tokenizer is not in the
converter's pre-tokenizer hash table, so an unrecognized one is written as ``gpt-2`` (the same
byte-level regex split), while known ones (SmolLM2) keep their own.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

from load.peer_server import PeerServer
from load.stack import ROOT

LLAMA_CPP_PYTHON = "0.3.36"
PEERS = ROOT / "build" / "peers"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
# Quantized peer runs: llama-quantize's type name, and our engine's method for the same bits.
QUANT_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0"}
QUANT_METHODS = {"q8_0": "int8", "q4_0": "int4"}


def source_dir(version: str = LLAMA_CPP_PYTHON) -> pathlib.Path:
    return PEERS / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def server_binary() -> pathlib.Path:
    return PEERS / "llama-build" / "bin" / "llama-server"


def cmake_configure_cmd(src: pathlib.Path, build: pathlib.Path) -> list[str]:
    # No curl/openssl (no downloads at run time), no web UI (it would fetch a prebuilt one), native
    # CPU flags (AVX2/AVX-512/AMX as this machine has them), no tests or examples.
    return ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
            "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DGGML_NATIVE=ON"]


def cmake_build_cmd(build: pathlib.Path, jobs: int, target: str = "llama-server") -> list[str]:
    return ["cmake", "--build", str(build), "--target", target, "-j", str(jobs)]


def quantize_binary() -> pathlib.Path:
    return PEERS / "llama-build" / "bin" / "llama-quantize"


def ensure_toolchain() -> None:
    missing = [t for t in ("cmake", "c++") if shutil.which(t) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise RuntimeError(f"building llama-server needs {', '.join(missing)}: apt-get install cmake g++")
    subprocess.run(["apt-get", "update"], check=True)
    subprocess.run(["apt-get", "install", "-y", "cmake", "g++"], check=True)


def ensure_llama_server(version: str = LLAMA_CPP_PYTHON, jobs: int | None = None) -> pathlib.Path:
    """The cached ``llama-server`` binary, downloading and building it on first use (minutes)."""
    binary = server_binary()
    if binary.exists():
        return binary
    ensure_toolchain()
    PEERS.mkdir(parents=True, exist_ok=True)
    src = source_dir(version)
    if not (src / "CMakeLists.txt").exists():
        sdist = PEERS / f"llama_cpp_python-{version}.tar.gz"
        if not sdist.exists():
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={version}", "-d", str(PEERS)], check=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(PEERS, filter="data")
    build = PEERS / "llama-build"
    print(f"building llama-server from {src} (several minutes)", file=sys.stderr, flush=True)
    subprocess.run(cmake_configure_cmd(src, build), check=True, stdout=subprocess.DEVNULL)
    subprocess.run(cmake_build_cmd(build, jobs or os.cpu_count() or 2), check=True, stdout=subprocess.DEVNULL)
    return binary


def ensure_llama_quantize(jobs: int | None = None) -> pathlib.Path | None:
    """The cached ``llama-quantize``, built on first use in the server's build tree (a minute once
    the server is built); None when it cannot be built (Q8_0 then comes from the converter)."""
    binary = quantize_binary()
    if binary.exists():
        return binary
    ensure_llama_server()
    print("building llama-quantize (once)", file=sys.stderr, flush=True)
    proc = subprocess.run(cmake_build_cmd(PEERS / "llama-build", jobs or os.cpu_count() or 2, "llama-quantize"),
                          stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    return binary if proc.returncode == 0 and binary.exists() else None


# --- GGUF conversion ------------------------------------------------------------------------------

_CONVERT = """
import runpy, sys
tree = sys.argv[1]
sys.path[:0] = [tree, tree + "/gguf-py"]
import conversion.base as base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:            # an unlisted byte-level BPE: the gpt-2 split
        return "gpt-2"
def no_sentencepiece(self, *a, **k):
    raise FileNotFoundError("byte-level BPE tokenizer: no sentencepiece model")
base.TextModel.get_vocab_base_pre = pre
base.TextModel._set_vocab_sentencepiece = no_sentencepiece
base.TextModel._set_vocab_llama_hf = no_sentencepiece
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(tree + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert_cmd(src: pathlib.Path, stage: pathlib.Path, out: pathlib.Path, dtype: str) -> list[str]:
    return [sys.executable, "-c", _CONVERT, str(src), str(stage), "--outfile", str(out),
            "--outtype", OUTTYPES[dtype]]


def staged_config(config: dict) -> dict:
    """config.json as the converter wants it: ``architectures`` and a top-level ``rope_theta``."""
    out = dict(config)
    out.setdefault("architectures", [ARCHITECTURES[config["model_type"]]])
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in out and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    return out


def stage_checkpoint(model_dir: pathlib.Path, stage: pathlib.Path | None = None) -> pathlib.Path:
    """``stage`` (default ``build/peers/gguf/.stage-<name>``): the checkpoint's files linked,
    config.json as the peers want it (:func:`staged_config`)."""
    stage = stage or PEERS / "gguf" / f".stage-{model_dir.name}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (stage / f.name).symlink_to(f)
    config = json.loads((model_dir / "config.json").read_text())
    (stage / "config.json").write_text(json.dumps(staged_config(config)))
    return stage


def convert_to_gguf(model_dir: pathlib.Path, dtype: str = "float32") -> pathlib.Path:
    """``build/peers/gguf/<name>-<type>.gguf``, converted once per checkpoint and dtype."""
    model_dir = pathlib.Path(model_dir).resolve()
    out = PEERS / "gguf" / f"{model_dir.name}-{OUTTYPES[dtype]}.gguf"
    if out.exists() and out.stat().st_mtime >= (model_dir / "config.json").stat().st_mtime:
        return out
    stage = stage_checkpoint(model_dir)
    tmp = out.with_suffix(".tmp")
    log = out.with_suffix(".log")
    with open(log, "wb") as f:
        proc = subprocess.run(convert_cmd(source_dir(), stage, tmp, dtype), stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"GGUF conversion of {model_dir} failed; see {log}")
    tmp.rename(out)
    shutil.rmtree(stage, ignore_errors=True)
    return out


def quantize_cmd(binary: pathlib.Path, src: pathlib.Path, out: pathlib.Path, qtype: str, threads: int) -> list[str]:
    """llama-quantize's default recipe for the type (what a llama.cpp user's Q8_0 / Q4_0 file is:
    Q4_0 keeps the output / tied embedding matrix in a K-quant)."""
    return [str(binary), str(src), str(out), QUANT_TYPES[qtype], str(threads)]


def quantize_gguf(model_dir: pathlib.Path, qtype: str) -> pathlib.Path:
    """``build/peers/gguf/<name>-<qtype>.gguf``: the f32 GGUF quantized by llama-quantize (Q8_0
    falls back to ``convert_hf_to_gguf.py --outtype q8_0`` when the quantizer cannot be built)."""
    if qtype not in QUANT_TYPES:
        raise ValueError(f"quantized peer type must be one of {', '.join(QUANT_TYPES)} (got {qtype!r})")
    model_dir = pathlib.Path(model_dir).resolve()
    src = convert_to_gguf(model_dir, "float32")
    out = PEERS / "gguf" / f"{model_dir.name}-{qtype}.gguf"
    if out.exists() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    binary = ensure_llama_quantize()
    tmp, log = out.with_suffix(".tmp"), out.with_suffix(".log")
    if binary is not None:
        cmd = quantize_cmd(binary, src, tmp, qtype, os.cpu_count() or 2)
    elif qtype == "q8_0":
        stage = stage_checkpoint(model_dir)
        cmd = [*convert_cmd(source_dir(), stage, tmp, "float32")[:-1], "q8_0"]
    else:
        raise RuntimeError(f"llama-quantize could not be built (see {PEERS / 'llama-build'}); {qtype} needs it")
    with open(log, "wb") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"quantizing {src} to {qtype} failed; see {log}")
    tmp.rename(out)
    return out


def import_ours(gguf: pathlib.Path) -> pathlib.Path:
    """The same quantized file as our checkpoint (``import-gguf --keep-quantized``), cached beside it."""
    from backend.model.gguf_import import import_gguf

    out = gguf.with_name(gguf.stem + "-ours")
    if (out / "config.json").exists() and (out / "config.json").stat().st_mtime >= gguf.stat().st_mtime:
        return out
    import_gguf(gguf, out, progress=None, keep_quantized=True)
    return out


# --- the server -----------------------------------------------------------------------------------

def server_cmd(binary: pathlib.Path, gguf: pathlib.Path, port: int, *, parallel: int, threads: int,
               ctx_per_slot: int, dtype: str = "float32", cache_type: str | None = None) -> list[str]:
    """``-np`` slots with continuous batching; the context is split evenly between slots. KV cache
    type: ``cache_type`` (llama.cpp's own default, f16, when None), or ``"same"`` = the weights'."""
    kv = [] if cache_type is None else ["-ctk", OUTTYPES[dtype] if cache_type == "same" else cache_type,
                                        "-ctv", OUTTYPES[dtype] if cache_type == "same" else cache_type]
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(parallel), "-c", str(parallel * ctx_per_slot), "-t", str(threads), "-tb", str(threads),
            *kv, "--cont-batching", "--no-webui"]


class LlamaServer(PeerServer):
    """``with LlamaServer(gguf, parallel=16) as srv: srv.url`` -- started, healthy, stopped on exit."""
    name = "llama-server"

    def __init__(self, gguf: pathlib.Path, *, parallel: int = 16, threads: int | None = None,
                 ctx_per_slot: int = 1024, dtype: str = "float32", cache_type: str | None = None) -> None:
        from backend.serving.launcher import free_port

        port = free_port()
        cmd = server_cmd(ensure_llama_server(), gguf, port, parallel=parallel,
                         threads=threads or os.cpu_count() or 2, ctx_per_slot=ctx_per_slot, dtype=dtype,
                         cache_type=cache_type)
        super().__init__(cmd, port, PEERS / "llama-server.log", start_timeout=120, stop_grace=10)
