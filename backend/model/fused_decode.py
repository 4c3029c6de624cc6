"""The fused CPU model step: a whole step through the model in one C call (all-decode batches and
varlen batches with prefill chunks: mixed steps, a prompt's first step, the partial last block after
a prefix-cache hit).

Why: at a few sequences a step of a small model is mostly Python and op dispatch, and MKL's GEMV
at M = 1 reads weights slower than memory allows. ``kernels/csrc/decode_cpu.c`` (``step_forward``)
runs embedding, every layer (RMSNorm, qkv, RoPE, KV store, causal paged attention through the block
tables, o-proj + residual, RMSNorm, gate/up, SiLU * up, down + residual), the final norm and the
lm_head for the logits rows only, with no Python in between. Faster than the torch path for every
step shape tried up to 2048-token prompts (bench/ab_fused_step.py), so the token budget is a cap.

When (:func:`make_fused_decoder` returns None otherwise and the torch path runs): CPU, the torch
attention backend, the C library built (``kernels.cpu.decode_library``), ``TRITON_LLM_FUSED_DECODE``
not ``0``, a KV cache of fp32 / fp16 / bf16, and either fp32 weights with plain or int8/int4
:class:`~backend.quant.linear.QuantLinear` projections (incl. ``lm_head_q``; those call the quant
library's ``w8_gemm`` / ``w4_gemm``, so they compute what QuantLinear computes), or a bf16 model on
a CPU with AVX512-BF16 or AVX2 + FMA: its weights are read as bf16 (packed copies made here for the
linears, :func:`_pack_bf16`), inputs rounded to bf16, products summed in fp32 (AMX, VDPBF16PS or
AVX2 kernels, docs/kernels.md "bf16 models"), the rest of the step in fp32. :meth:`FusedDecoder.accepts`
takes every all-decode batch and prefill chunks of at most ``TRITON_LLM_FUSED_MAX_TOKENS`` new
tokens (default :data:`MAX_TOKENS`; 0 = all-decode steps only).

Numerics: fp32 is the torch path's operations in another summation order (logits within ~1e-5
relative, tests/unit/test_model_fused_decode.py); bf16 agrees with transformers in bf16 to bf16's
precision (tests/unit/test_model_dtype.py). fp32 linears of ``M >= TRITON_LLM_FUSED_GEMM_MIN_M`` rows
call MKL's ``sgemm_`` from torch's library; bf16 ones MKL's ``cblas_gemm_bf16bf16f32`` from the
crossover M measured on this host (backend/model/bf16_gemm.py). Every output element is computed by
one chunk of a parallel loop, so the thread count never changes the bits.

Threads: the parallel loops run on the C library's own worker pool (the caller never waits for a
worker that has not started; ``step_pool_set(0)``: OpenMP regions) with ``torch.get_num_threads()``.
"""
from __future__ import annotations

import ctypes
import logging
import pathlib

import torch

from backend.model import bf16_gemm, loader
from backend.lora.batch import LoRABatch
from backend.lora.fused import CStep
from backend.model.llama import Linear, LlamaForCausalLM
from common import env

log = logging.getLogger("triton_llm.model")
MAX_TOKENS = 8192  # steps with a prefill chunk: fused up to this many new tokens (faster up to 2048 measured, bench/ab_fused_step.py)
QUANT_MAX_TOKENS = 192  # int4 projections: past this the torch path (dequantize + MKL) is faster
KEEP_ROWS = 256    # the decoder keeps its scratch for steps up to this many tokens; larger ones get their own
GEMM_MIN_M = 64    # measured on a Zen 3 core: the C tiles beat MKL up to at least M = 32 (docs/kernels.md)
_P, _I = ctypes.c_void_p, ctypes.c_int64
_LAYER_FIELDS = ("ln1", "qkv_w", "qkv_b", "o_w", "o_b", "ln2", "gu_w", "gu_b", "down_w", "down_b",
                 "k_cache", "v_cache")


_PROJ = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")    # P_QKV .. P_DOWN in decode_cpu.c
_KIND = {"int8": 1, "int4": 2}                                    # Q_INT8, Q_INT4 (0: fp32)
Q_BF16 = 3                                                        # a bf16 weight read in place


class _Model(ctypes.Structure):
    """Mirror of ``Model`` in kernels/csrc/decode_cpu.c (same field order)."""
    _fields_ = ([(n, _I) for n in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "inter",
                                   "vocab", "block_size", "max_pos", "gemm_min_m")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(n, _P) for n in ("embed", "norm", "lm_head", "cos", "sin", *_LAYER_FIELDS, "sgemm",
                                     "qw", "head_q", "w8", "w4")]
                + [("kv_dtype", _I), ("embed_dtype", _I), ("bf16_avx2", _I), ("bgemm", _P), ("bgemm_min_m", _I),
                   ("mkl_threads_local", _P)]
                + [("lora", _P)])     # this step's LoRA groups (backend/lora/fused.py) or NULL
_KV_DTYPE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}   # KV_F32 / KV_F16 / KV_BF16


class _QW(ctypes.Structure):
    """Mirror of ``QW`` in kernels/csrc/decode_cpu.c: one projection's quantized weight (kind 0: fp32)."""
    _fields_ = [("kind", _I), ("group", _I), ("w", _P), ("scales", _P), ("zeros", _P), ("packed", _P)]


def _is_quant(mod) -> bool:
    return mod.__class__.__name__ == "QuantLinear"


def _qw(mod) -> _QW:
    if not _is_quant(mod):
        return _QW(kind=Q_BF16, w=mod.weight.data_ptr()) if mod.weight.dtype == torch.bfloat16 else _QW(kind=0)
    w, group = mod.c_weight()        # int8 groups of 32: the packed buffer (backend/quant/csrc/w8_packed.c)
    return _QW(kind=_KIND[mod.method], group=group, w=w,
               scales=mod.scales.data_ptr(), zeros=None if mod.zeros is None else mod.zeros.data_ptr())


def _quant_ok(mod) -> bool:
    """A QuantLinear the C GEMMs can read in place: int8/int4, CPU, contiguous, fp32 bias."""
    ts = [mod.qweight, mod.scales] + ([] if mod.zeros is None else [mod.zeros])
    return (mod.method in _KIND and (mod.method == "int8") == (mod.zeros is None)
            and all(t.device.type == "cpu" and t.is_contiguous() for t in ts)
            and mod.scales.dtype == torch.float16 and (mod.zeros is None or mod.zeros.dtype == torch.float16)
            and _f32(mod.bias))


def _quant_gemms() -> tuple[int, int] | None:
    """Addresses of w8_gemm / w4_gemm in the already-built quant library (backend/quant/cpu.py)."""
    from backend.quant import cpu as qcpu

    lib = qcpu.library()
    if lib is None:
        return None
    return ctypes.cast(lib.w8_gemm, _P).value, ctypes.cast(lib.w4_gemm, _P).value


def enabled() -> bool:
    return env.flag("TRITON_LLM_FUSED_DECODE")


def max_tokens() -> int:
    """Steps with prefill chunks take the fused step up to this many new tokens
    (``TRITON_LLM_FUSED_MAX_TOKENS``; 0: all-decode steps only)."""
    return env.integer("TRITON_LLM_FUSED_MAX_TOKENS", MAX_TOKENS)


def _mkl_sgemm() -> int | None:
    """Address of MKL's Fortran ``sgemm_`` in torch's CPU library, or None where it is not exported."""
    try:
        lib = ctypes.CDLL(str(pathlib.Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        return ctypes.cast(lib.sgemm_, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def _f32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())


def _bf16(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous())


def _pack_bf16(lib, qws, weights) -> list[torch.Tensor]:
    """Packed copies (kernels/csrc/bf16_packed.c) of the bf16 weights [N, K] of ``qws``, pointed to
    by their ``packed`` field; returned to be kept alive. They run the linears without horizontal
    sums: VDPBF16PS ~3x faster from M = 4 rows than the row-major tiles, AVX2 ~1.5x (docs/kernels.md).
    They double the bf16 weights' memory (the embedding rows and the torch path read the originals); a
    decode reads these, from one huge-page arena as the loader's (4 KiB pages: ~4 % slower, bench/ab_bf16_decode.py)."""
    todo = [(qw, w) for qw, w in zip(qws, weights) if qw is not None and w is not None and qw.kind == Q_BF16 and not w.shape[1] % 2]
    sizes = [-(-lib.bf16_packed_elems(*w.shape) // 32) * 32 for _, w in todo]   # 64-byte aligned
    arena = loader.weight_arena(2 * sum(sizes)).view(torch.int16) if todo and loader.huge_pages_enabled() else None
    keep, off = [], 0
    for (qw, w), size in zip(todo, sizes):
        packed = torch.empty(size, dtype=torch.int16) if arena is None else arena[off:off + size]
        off += size
        lib.bf16_pack(w.data_ptr(), *w.shape, packed.data_ptr())
        qw.packed = packed.data_ptr()
        keep.append(packed)
    return keep


class FusedDecoder:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, lib, bf16_avx2: bool = False, bgemm_min_m: int | None = None):
        """``bf16_avx2``: a bf16 model's linears on the AVX2 kernels even where the CPU has
        AVX512-BF16 (tests and A/B tools pin that variant on such hosts; without AVX512-BF16 the
        library uses them anyway). ``bgemm_min_m``: a bf16 model's linears of at least this many
        rows go to MKL's bf16 GEMM; None: the crossover measured on this host
        (backend/model/bf16_gemm.py); tests pin it (1: MKL at every M, ``bf16_gemm.NEVER``: never)."""
        cfg, rot = model.cfg, model.rotary
        self._lib = lib
        self._keep = []           # ctypes pointer arrays the struct points into
        layers = model.model.layers
        # A bf16 model: its projections, lm_head and embedding are read in place as bf16 (AMX,
        # VDPBF16PS or AVX2 tiles); the norm weights and biases, small, get fp32 copies for the fp32 rest of the step.
        self.bf16 = model.model.embed_tokens.dtype == torch.bfloat16

        def w(mod):                 # fp32 weight, or None for a QuantLinear / bf16 one (read through qw)
            return None if _is_quant(mod) or mod.weight.dtype == torch.bfloat16 else mod.weight

        def f32(t):
            return None if t is None else t.float().contiguous()

        per_layer = {
            "ln1": [f32(x.input_layernorm.weight) for x in layers],
            "qkv_w": [w(x.self_attn.qkv_proj) for x in layers],
            "qkv_b": [f32(x.self_attn.qkv_proj.bias) for x in layers],
            "o_w": [w(x.self_attn.o_proj) for x in layers],
            "o_b": [f32(x.self_attn.o_proj.bias) for x in layers],
            "ln2": [f32(x.post_attention_layernorm.weight) for x in layers],
            "gu_w": [w(x.mlp.gate_up_proj) for x in layers],
            "gu_b": [f32(x.mlp.gate_up_proj.bias) for x in layers],
            "down_w": [w(x.mlp.down_proj) for x in layers],
            "down_b": [f32(x.mlp.down_proj.bias) for x in layers],
            "k_cache": [k for k, _ in kv_caches],
            "v_cache": [v for _, v in kv_caches],
        }
        arrays = {}
        for name, tensors in per_layer.items():
            arr = (_P * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])
            self._keep.append(arr)
            arrays[name] = ctypes.cast(arr, _P)
        sgemm = _mkl_sgemm()
        projs = [getattr(x.self_attn if p in ("qkv_proj", "o_proj") else x.mlp, p) for x in layers for p in _PROJ]
        head = getattr(model, "lm_head_q", None)
        head_qw = _qw(head) if head is not None else (_QW(kind=Q_BF16, w=model.lm_head_weight().data_ptr())
                                                        if self.bf16 else None)
        quant = {}
        self.quantized = any(_is_quant(p) for p in projs)     # int8/int4 projections (not just the head)
        self.int4 = any(_is_quant(p) and p.method == "int4" for p in projs)
        if self.quantized or self.bf16 or head is not None:
            self._qw = (_QW * len(projs))(*[_qw(p) for p in projs])
            self._head_q = head_qw
            w8, w4 = _quant_gemms() if self.quantized or head is not None else (None, None)
            quant = dict(qw=ctypes.cast(self._qw, _P), w8=w8, w4=w4,
                         head_q=None if head_qw is None else ctypes.cast(ctypes.pointer(self._head_q), _P))
            self._quant_mods = [*projs, head]                 # keep their tensors alive with us
            if self.bf16:
                weights = [p.weight for p in projs] + [model.lm_head_weight() if head is None else None]
                self._packed = _pack_bf16(lib, [*self._qw, self._head_q], weights)
        bgemm = bf16_gemm.mkl_symbols() if self.bf16 else None
        norm = f32(model.model.norm.weight)
        self._struct = _Model(
            num_layers=cfg.num_layers, hidden=cfg.hidden_size, num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, inter=cfg.intermediate_size,
            vocab=cfg.vocab_size, block_size=block_size, max_pos=rot.cos.shape[0],
            gemm_min_m=env.integer("TRITON_LLM_FUSED_GEMM_MIN_M", GEMM_MIN_M) if sgemm else 1 << 62,
            bgemm=bgemm and bgemm[0], mkl_threads_local=bgemm and bgemm[1], bgemm_min_m=bf16_gemm.NEVER,
            eps=cfg.rms_norm_eps, scale=cfg.head_dim ** -0.5,
            embed=model.model.embed_tokens.data_ptr(), norm=norm.data_ptr(),
            lm_head=None if self.bf16 else model.lm_head_weight().data_ptr(), cos=rot.cos.data_ptr(),
            sin=rot.sin.data_ptr(), sgemm=sgemm, kv_dtype=_KV_DTYPE[kv_caches[0][0].dtype],
            embed_dtype=_KV_DTYPE[model.model.embed_tokens.dtype], bf16_avx2=int(bf16_avx2), **arrays, **quant)
        if bgemm:                   # MKL's bf16 GEMM from the crossover measured on this host (or the caller's)
            avx2 = bool(bf16_avx2 or not lib.bf16_dot_supported())
            shapes = [tuple(p.weight.shape) for p in projs[:len(_PROJ)]]      # layer 0's four projections
            self._struct.bgemm_min_m = (bf16_gemm.crossover(lib, self._struct, shapes, torch.get_num_threads(), avx2)
                                        if bgemm_min_m is None else bgemm_min_m)
        self.bgemm_min_m = self._struct.bgemm_min_m
        self._tensors = {**per_layer, "norm": [norm]}   # the pointers above stay valid while these live
        self._vocab, self._cfg = cfg.vocab_size, cfg
        self._scratch = torch.empty(0)
        self.max_tokens = max_tokens()

    def accepts(self, num_tokens: int, num_seqs: int) -> bool:
        """Every all-decode step (each sequence brings one token); a step with prefill chunks
        (mixed or prefill-only) when its new tokens are at most :attr:`max_tokens` -- for a model
        with int4 projections at most QUANT_MAX_TOKENS: past that, the torch path's dequantize +
        MKL sgemm beats the int4 GEMM. int8 on its packed layout is faster at every length (SmolLM2
        prefill, 2 threads, loaded Zen 4: fused 252 / 264 / 614 / 1567 ms against 314 / 384 / 3968 /
        3115 at 192 / 256 / 512 / 1024 tokens)."""
        if num_tokens == num_seqs:
            return True
        return num_tokens <= (min(self.max_tokens, QUANT_MAX_TOKENS) if self.int4 else self.max_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, logits_indices: torch.Tensor,
                cu_seqlens_q: torch.Tensor | None = None, lora: LoRABatch | None = None) -> torch.Tensor:
        """All CPU tensors as in BatchInput -> fp32 logits [num_logits, vocab]. ``cu_seqlens_q``
        None: one token per sequence (row i = sequence i). ``lora``: adapter rows, their products added in C."""
        m, nseqs = input_ids.shape[0], seq_lens.shape[0]
        if cu_seqlens_q is None:
            if m != nseqs:
                raise ValueError("fused step: cu_seqlens_q is needed when a sequence brings several tokens")
            cu_seqlens_q = torch.arange(m + 1, dtype=torch.int32)
        ids = input_ids.to(torch.int64).contiguous()
        pos = positions.to(torch.int64).contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        cu = cu_seqlens_q.to(torch.int32).contiguous()
        ctx = seq_lens.to(torch.int32).contiguous()
        rows = logits_indices.to(torch.int64).contiguous()
        need = self._lib.decode_scratch_floats(ctypes.byref(self._struct), m)
        scratch = self._scratch
        if scratch.numel() < need:
            scratch = torch.empty(need, dtype=torch.float32)
            if m <= KEEP_ROWS:          # a long prompt's scratch (~32 KB per token on SmolLM2) is not kept
                self._scratch = scratch
        logits = torch.empty(rows.shape[0], self._vocab, dtype=torch.float32)
        groups = None if lora is None else CStep.for_model(lora, self._cfg)   # alive through the call
        self._struct.lora = None if groups is None else groups.address
        rc = self._lib.step_forward(ctypes.byref(self._struct), m, nseqs, ids.data_ptr(), pos.data_ptr(),
                                    slots.data_ptr(), cu.data_ptr(), ctx.data_ptr(), tables.data_ptr(),
                                    tables.shape[1], rows.shape[0], rows.data_ptr(), scratch.data_ptr(),
                                    logits.data_ptr(), torch.get_num_threads())
        if rc == -2:
            raise ValueError("fused step: a token id, position, logits row or sequence layout is out of range")
        if rc != 0:
            raise MemoryError("fused step: scratch allocation failed")
        return logits


def make_fused_decoder(model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                       block_size: int, attention) -> FusedDecoder | None:
    """A FusedDecoder when this model and device qualify (module docstring), else None."""
    from backend.model.attention import TorchAttention
    from kernels.cpu import decode_library

    if not enabled() or not isinstance(attention, TorchAttention) or model.cfg.head_dim % 2:
        return None
    linears = [m for m in model.modules() if m.__class__.__name__.endswith("Linear")]
    quant = [m for m in linears if _is_quant(m)]
    bf16 = model.model.embed_tokens.dtype == torch.bfloat16
    if any(not _quant_ok(m) for m in quant) or (bf16 and quant):
        return None                                       # a layout the C GEMMs do not read
    ok = _bf16 if bf16 else _f32
    if any(type(m) is not Linear or not ok(m.weight) or not ok(m.bias) for m in linears if not _is_quant(m)):
        return None                                       # not fp32 (or all bf16) on CPU
    if quant and _quant_gemms() is None:
        return None                                       # the quant C library is not built
    caches = [t for kv in kv_caches for t in kv]
    if (not caches or len({t.dtype for t in caches}) != 1 or caches[0].dtype not in _KV_DTYPE
            or not all(t.device.type == "cpu" and t.is_contiguous() for t in caches)):
        return None                                       # KV: one of fp32 / fp16 / bf16 (kv_cache_dtype), CPU
    norms = [x.weight for x in model.modules() if hasattr(x, "eps")]
    if (not all(_f32(t) for t in (model.rotary.cos, model.rotary.sin))
            or not all(ok(t) for t in (model.model.embed_tokens, model.lm_head_weight(), *norms))):
        return None
    lib = decode_library()
    if lib is None:
        return None
    if bf16 and not lib.bf16_supported():
        return None                                       # neither AVX512-BF16 nor AVX2 + FMA: the torch path
    log.info("fused CPU decode step on (kernels/csrc/decode_cpu.c%s)", ", bf16 weights" if bf16 else "")
    return FusedDecoder(model, kv_caches, block_size, lib)
