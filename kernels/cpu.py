"""The CPU kernels of ``kernels/csrc/paged_cpu.c``: built once with the system C compiler, cached,
called through ctypes; ``None`` from :func:`library` means "use the torch path".

Why C through ctypes rather than a torch C++ extension: the file needs no torch headers, so it
builds in about a second (a ``torch.utils.cpp_extension`` build compiles torch's headers for a
minute on 2 cores), and it is independent of the torch version. ctypes releases the GIL during the
call, so the engine's response thread runs meanwhile.

Cache: ``build/kernels/paged_cpu-<hash>.so`` where the hash covers the source, the compiler flags
and this CPU's flags (``-march=native`` code must not run on another CPU), or
``$TRITON_LLM_KERNEL_CACHE``. ``TRITON_LLM_CPU_KERNELS=0`` turns the kernels off.

:func:`decode_library` is the second library: ``csrc/decode_cpu.c`` (a whole model step, decodes
and short prefill chunks, in one call; used by backend/model/fused_decode.py) linked with
``paged_cpu.c``, built with OpenMP (torch's own ``libgomp`` serves it at run time) or, if that
fails, without.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import torch

log = logging.getLogger("triton_llm.kernels")
SOURCE = pathlib.Path(__file__).with_name("csrc") / "paged_cpu.c"
DECODE_SOURCE = SOURCE.with_name("decode_cpu.c")
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC"]
DECODE_FLAGS = [["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"], FLAGS]   # first that builds
_P = ctypes.c_void_p
_I = ctypes.c_int64


def _cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> pathlib.Path:
    env = os.environ.get("TRITON_LLM_KERNEL_CACHE")
    if env:
        return pathlib.Path(env)
    repo_build = pathlib.Path(__file__).resolve().parents[1] / "build" / "kernels"
    try:
        repo_build.mkdir(parents=True, exist_ok=True)
        if os.access(repo_build, os.W_OK):
            return repo_build
    except OSError:
        pass
    return pathlib.Path(tempfile.gettempdir()) / "triton_llm_kernels"


def _disabled() -> bool:
    return os.environ.get("TRITON_LLM_CPU_KERNELS", "1").lower() in ("0", "false", "off", "no")


def _build(source: pathlib.Path = SOURCE, flags: list[str] = FLAGS,
           extra: tuple[pathlib.Path, ...] = ()) -> pathlib.Path | None:
    """Build ``source`` (+ ``extra`` sources into the same library) once into the cache (also used
    by backend/quant/cpu.py); None on failure."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    headers = sorted(source.parent.glob("*.h"))          # included by the sources (simd_exp.h)
    key = hashlib.sha256(source.read_bytes() + b"".join(p.read_bytes() for p in (*extra, *headers))
                         + " ".join(flags).encode() + _cpu_flags().encode()
                         + platform.machine().encode()).hexdigest()[:16]
    out = _cache_dir() / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    proc = subprocess.run([cc, *flags, "-o", str(tmp), str(source), *map(str, extra), "-lm"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        log.warning("CPU kernel %s did not build (torch fallback): %s", source.name, proc.stderr[-500:])
        return None
    os.replace(tmp, out)            # atomic: processes building at once each publish a whole file
    return out


@functools.lru_cache(maxsize=1)
def library():
    """The loaded kernels, or None (disabled, no compiler, build failed)."""
    if _disabled():
        return None
    try:
        path = _build()
        if path is None:
            return None
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("CPU attention kernel unavailable (torch fallback): %s", exc)
        return None
    for name in ("attend_f32", "attend_bf16", "attend_f16"):
        fn = getattr(lib, name)
        fn.argtypes = [_P, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P]
        fn.restype = ctypes.c_int
    lib.store_kv.argtypes = [_P, _P, _P, _P, _P, _I, _I]
    lib.store_kv.restype = None
    lib.f32_to_half.argtypes = [_P, _P, _I, ctypes.c_int]
    lib.f32_to_half.restype = None
    return lib


ATTEND = {torch.float32: "attend_f32", torch.bfloat16: "attend_bf16", torch.float16: "attend_f16"}
HALF_KIND = {torch.float16: 1, torch.bfloat16: 2}       # f32_to_half's kind (decode_cpu.c KV_F16 / KV_BF16)


def to_half(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``x`` -> fp16 / bf16 through the C conversion the fused step stores K/V with (tests)."""
    x = x.to(torch.float32).contiguous()
    out = torch.empty(x.shape, dtype=dtype)
    library().f32_to_half(x.data_ptr(), out.data_ptr(), x.numel(), HALF_KIND[dtype])
    return out


def supports(cache_dtype: torch.dtype, device) -> bool:
    return torch.device(device).type == "cpu" and cache_dtype in ATTEND and library() is not None


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] (cache dtype, contiguous) -> their slots; slot -1 is skipped."""
    row_bytes = key.shape[1] * key.shape[2] * key.element_size()
    slot_mapping = slot_mapping.to(torch.int64).contiguous()
    library().store_kv(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                       slot_mapping.data_ptr(), key.shape[0], row_bytes)


def attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           rows: torch.Tensor, seq: torch.Tensor, ctx: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """For each i: out[rows[i]] = attention of query[rows[i]] over the first ctx[i] tokens of
    sequence seq[i] (its block table row). query/out fp32 [T, Hq, D] contiguous; block_tables int32
    contiguous; rows int64, seq/ctx int32."""
    _, bs, hkv, d = k_cache.shape
    rc = getattr(library(), ATTEND[k_cache.dtype])(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], rows.data_ptr(), seq.data_ptr(), ctx.data_ptr(), rows.shape[0],
        query.shape[1], hkv, d, bs, scale, out.data_ptr())
    if rc != 0:
        raise MemoryError("paged CPU attention: scratch allocation failed")


@functools.lru_cache(maxsize=1)
def decode_library():
    """The fused model step (``step_forward``: decodes and prefill chunks), or None (disabled, no compiler, build failed)."""
    if _disabled():
        return None
    for flags in DECODE_FLAGS:
        try:
            path = _build(DECODE_SOURCE, flags, extra=(SOURCE,))
            if path is None:
                continue
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            log.warning("fused CPU decode library did not load with %s: %s", flags, exc)
            continue
        lib.step_forward.argtypes = [_P, _I, _I, _P, _P, _P, _P, _P, _P, _I, _I, _P, _P, _P, ctypes.c_int]
        lib.step_forward.restype = ctypes.c_int
        lib.decode_scratch_floats.argtypes = [_P, _I]
        lib.decode_scratch_floats.restype = _I
        lib.linear_f32.argtypes = [_P, _I, _I, _P, _P, _I, _P, ctypes.c_int, ctypes.c_int]
        lib.linear_f32.restype = None
        lib.step_pool_set.argtypes = [ctypes.c_int]
        lib.step_pool_set.restype = None
        lib.bf16_dot_supported.argtypes = []
        lib.bf16_dot_supported.restype = ctypes.c_int
        lib.amx_supported.argtypes = []
        lib.amx_supported.restype = ctypes.c_int
        lib.amx_set.argtypes = [ctypes.c_int]
        lib.amx_set.restype = None
        lib.linear_bf16_test.argtypes = [_P, _I, _I, _P, _P, _I, _P, ctypes.c_int, ctypes.c_int]
        lib.linear_bf16_test.restype = ctypes.c_int
        return lib
    return None
