"""The CPU kernels of ``kernels/csrc/paged_cpu.c`` (+ ``kv_half.c``): built once with the system C compiler, cached,
called through ctypes; ``None`` from :func:`library` means "use the torch path".

Why C through ctypes rather than a torch C++ extension: the file needs no torch headers, so it
builds in about a second (a ``torch.utils.cpp_extension`` build compiles torch's headers for a
minute on 2 cores), and it is independent of the torch version. ctypes releases the GIL during the
call, so the engine's response thread runs meanwhile.

Cache: ``build/kernels/paged_cpu-<hash>.so`` where the hash covers the source, the compiler flags
and this CPU's flags (``-march=native`` code must not run on another CPU), or
``$TRITON_LLM_KERNEL_CACHE``; where the repository is not writable, ``~/.cache/triton_llm/kernels``.
Why the checks: ``ctypes.CDLL`` runs a library's constructors in this process, so a library another
user could plant or change is code execution as us. The folder must be owned by this user and is
made (or tightened to) mode 0700; a folder owned by someone else is refused, and a cached library
is loaded only if it is ours and not group/other-writable (else rebuilt). No predictable shared
``/tmp`` path: with no usable folder the kernels are off (the torch path). ``TRITON_LLM_CPU_KERNELS=0``
turns the kernels off.

:func:`decode_library` is the second library: ``csrc/decode_cpu.c`` (a whole model step, decodes
and prefill chunks, in one call; used by backend/model/fused_decode.py) built with the other
:data:`DECODE_SOURCES` (its worker pool, fp32 / bf16 / AMX linears, the attention of ``paged_cpu.c``)
into one library, with OpenMP (torch's own ``libgomp`` serves it at run time) or, if that fails,
without. Symbols one source calls in another are hidden (``decode_cpu.h``'s ``INTERNAL``).
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
import stat
import subprocess

import torch

from common import env

log = logging.getLogger("triton_llm.kernels")
SOURCE = pathlib.Path(__file__).with_name("csrc") / "paged_cpu.c"
PAGED_EXTRA = (SOURCE.with_name("kv_half.c"),)                # linked into the attention library
DECODE_SOURCE = SOURCE.with_name("decode_cpu.c")
DECODE_EXTRA = tuple(SOURCE.with_name(f) for f in (          # linked into the decode library
    "step_pool.c", "linear_f32.c", "linear_bf16.c", "bf16_packed.c", "amx_bf16.c", "bf16_avx2.c", "paged_cpu.c", "kv_half.c", "lora_cpu.c"))
DECODE_SOURCES = (DECODE_SOURCE, *DECODE_EXTRA)
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


def _private_dir(d: pathlib.Path, uid: int | None = None) -> bool:
    """Make ``d`` (if missing) and check it is a real folder owned by ``uid`` (this user); tighten
    it to 0700. False (and a warning) when it cannot be made or belongs to someone else."""
    uid = os.geteuid() if uid is None else uid
    try:
        d.mkdir(parents=True, mode=0o700, exist_ok=True)
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            log.warning("kernel cache %s is not a folder owned by uid %d: not used", d, uid)
            return False
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(d, 0o700)
        return True
    except OSError as exc:
        log.warning("kernel cache %s unusable: %s", d, exc)
        return False


def _cache_dir(uid: int | None = None) -> pathlib.Path | None:
    """The compiled-kernel folder (module docstring), or None: no private folder to be had."""
    chosen = env.raw("TRITON_LLM_KERNEL_CACHE")
    if chosen:                  # the user's explicit choice: that folder or none
        return pathlib.Path(chosen) if _private_dir(pathlib.Path(chosen), uid) else None
    for d in (pathlib.Path(__file__).resolve().parents[1] / "build" / "kernels",
              pathlib.Path.home() / ".cache" / "triton_llm" / "kernels"):
        if _private_dir(d, uid):
            return d
    return None


def _trusted(lib: pathlib.Path, uid: int | None = None) -> bool:
    """A library we may load: a regular file owned by ``uid`` and writable by no one else, in a
    folder owned by ``uid`` with mode 0700."""
    uid = os.geteuid() if uid is None else uid
    try:
        d, f = os.lstat(lib.parent), os.lstat(lib)
    except OSError:
        return False
    return (stat.S_ISDIR(d.st_mode) and d.st_uid == uid and stat.S_IMODE(d.st_mode) == 0o700
            and stat.S_ISREG(f.st_mode) and f.st_uid == uid and not f.st_mode & 0o022)


def load_library(path: pathlib.Path) -> ctypes.CDLL:
    """``ctypes.CDLL`` of a library in the kernel cache, after :func:`_trusted`; OSError if not."""
    if not _trusted(path):
        raise OSError(f"refusing to load {path}: not owned by this user in a private (0700) folder")
    return ctypes.CDLL(str(path))


def _disabled() -> bool:
    return not env.flag("TRITON_LLM_CPU_KERNELS")


def _build(source: pathlib.Path = SOURCE, flags: list[str] = FLAGS,
           extra: tuple[pathlib.Path, ...] | None = None) -> pathlib.Path | None:
    """Build ``source`` (+ ``extra`` sources into the same library; None: :data:`PAGED_EXTRA` for
    :data:`SOURCE`, none for another) once into the cache (also used by backend/quant/cpu.py);
    None on failure."""
    if extra is None:
        extra = PAGED_EXTRA if source == SOURCE else ()
    cc = shutil.which(env.raw("CC") or "cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    headers = sorted(source.parent.glob("*.h"))          # included by the sources (simd_exp.h)
    key = hashlib.sha256(source.read_bytes() + b"".join(p.read_bytes() for p in (*extra, *headers))
                         + " ".join(flags).encode() + _cpu_flags().encode()
                         + platform.machine().encode()).hexdigest()[:16]
    cache = _cache_dir()
    if cache is None:
        return None
    out = cache / f"{source.stem}-{key}.so"
    if out.exists() and _trusted(out):
        return out
    tmp = out.with_name(f".{out.name}.{os.getpid()}")       # a stale or foreign file is replaced
    proc = subprocess.run([cc, *flags, "-o", str(tmp), str(source), *map(str, extra), "-lm"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        log.warning("CPU kernel %s did not build (torch fallback): %s", source.name, proc.stderr[-500:])
        return None
    os.chmod(tmp, 0o700)            # whatever the umask: writable by no one else (_trusted)
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
        lib = load_library(path)
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
            path = _build(DECODE_SOURCE, flags, extra=DECODE_EXTRA)
            if path is None:
                continue
            return load_decode(path)
        except OSError as exc:
            log.warning("fused CPU decode library did not load with %s: %s", flags, exc)
    return None


def load_decode(path: pathlib.Path):
    """The decode library at ``path`` (a cache entry) with its signatures declared."""
    lib = load_library(path)
    lib.step_forward.argtypes = [_P, _I, _I, _P, _P, _P, _P, _P, _P, _I, _I, _P, _P, _P, ctypes.c_int]
    lib.step_forward.restype = ctypes.c_int
    lib.decode_scratch_floats.argtypes = [_P, _I]
    lib.decode_scratch_floats.restype = _I
    lib.linear_f32.argtypes = [_P, _I, _I, _P, _P, _I, _P, ctypes.c_int, ctypes.c_int]
    lib.linear_f32.restype = None
    lib.step_pool_set.argtypes = [ctypes.c_int]
    lib.step_pool_set.restype = None
    for name in ("bf16_dot_supported", "bf16_avx2_supported", "bf16_supported", "amx_supported"):
        getattr(lib, name).argtypes = []
        getattr(lib, name).restype = ctypes.c_int
    lib.amx_set.argtypes = [ctypes.c_int]
    lib.amx_set.restype = None
    if not env.flag("TRITON_LLM_AMX"):        # the C code reads no environment: told here
        lib.amx_set(0)
    lib.linear_bf16_test.argtypes = [_P, _I, _I, _P, _P, _I, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.linear_bf16_test.restype = ctypes.c_int
    lib.linear_bf16_with.argtypes = [_P, _P, _I, _I, _P, _P, _P, _I, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.linear_bf16_with.restype = ctypes.c_int
    lib.bf16_packed_elems.argtypes = [_I, _I]
    lib.bf16_packed_elems.restype = _I
    lib.bf16_pack.argtypes = [_P, _I, _I, _P]
    lib.bf16_pack.restype = None
    return lib
