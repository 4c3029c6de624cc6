"""The CPU kernels of ``kernels/csrc/paged_cpu.c`` (+ ``kv_half.c``): built once with the system C compiler, cached,
called through ctypes; ``None`` from :func:`library` means "use the torch path".

Why C through ctypes rather than a torch C++ extension: the file needs no torch headers, so it
builds in about a second (a ``torch.utils.cpp_extension`` build compiles torch's headers for a
minute on 2 cores), and it is independent of the torch version. ctypes releases the GIL during the
call, so the engine's response thread runs meanwhile.

Cache and trust: common/native.py (``build/kernels/paged_cpu-<hash>.so``, a private 0700 folder,
owner-checked before loading; no shared ``/tmp`` fallback: with no usable folder the kernels are
off, the torch path). ``TRITON_LLM_CPU_KERNELS=0`` turns the kernels off.

:func:`decode_library` is the second library: ``csrc/decode_cpu.c`` (a whole model step, decodes
and prefill chunks, in one call; used by backend/model/fused_decode.py) built with the other
:data:`DECODE_SOURCES` (its worker pool, fp32 / bf16 / AMX linears, the attention of ``paged_cpu.c``)
into one library, with OpenMP (torch's own ``libgomp`` serves it at run time) or, if that fails,
without. Symbols one source calls in another are hidden (``decode_cpu.h``'s ``INTERNAL``).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import pathlib

import torch

from common import env
from common.native import build, load_library

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


def _disabled() -> bool:
    return not env.flag("TRITON_LLM_CPU_KERNELS")


def _build(source: pathlib.Path = SOURCE, flags: list[str] = FLAGS,
           extra: tuple[pathlib.Path, ...] | None = None) -> pathlib.Path | None:
    """Build ``source`` (+ ``extra``; None: :data:`PAGED_EXTRA` for :data:`SOURCE`, none for another)
    once into the cache (common/native.py; also used by backend/quant/cpu.py); None on failure."""
    if extra is None:
        extra = PAGED_EXTRA if source == SOURCE else ()
    return build(source, flags, extra, what="CPU kernel (torch fallback)")


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
