"""Weight-only quantized GEMM (W8A16 / W4A16): y[M, N] = x[M, K] . dequant(W)[N, K]^T (+ bias).

Grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))``. A program walks K in BLOCK_K steps: it loads its
x tile, loads the packed weight tile and the tile's group scales (and zeros), dequantizes in
registers and accumulates ``tl.dot`` in fp32. Layouts are backend/quant/layout.py's:

    int8  qweight int8 [N, K];             W = q * scales[n, k // G]
    int4  qweight uint8 [N, ceil(K/32)*16]: value k of a row sits in byte (k // 32) * 16 + k % 16,
          low nibble when (k // 16) is even, high nibble otherwise;
                                           W = (q - 8) * scales[n, k // G] + zeros[n, k // G]

Scales and zeros are fp16 [N, ceil(K / G)]. Any K and any G (int4: a multiple of 32) work: the
group of each k is looked up per element, so a K tile may span groups and K need not be a
multiple of anything. Activations bf16/fp16 use tensor-core dots on the weight tile cast to
their dtype (fp32 accumulation); fp32 activations use exact fp32 products (``ieee``), as the
attention kernel does. Under the interpreter every load is converted to fp32 at once (its bf16
arithmetic is not faithful) and blocks are large, since each program costs Python time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .device import check_device, interpreted


@triton.jit
def _quant_gemm_kernel(
    x_ptr,          # [M, K] fp32 / bf16 / fp16, unit last stride
    w_ptr,          # int8 [N, K] or uint8 [N, KB * 16]
    s_ptr,          # fp16 [N, NG]
    z_ptr,          # fp16 [N, NG] (BITS == 4)
    b_ptr,          # [N] (HAS_BIAS)
    y_ptr,          # [M, N]
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,           # interpreter: everything in fp32
    DOT_PRECISION: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm64[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        wmask = k_ok[:, None] & n_ok[None, :]                          # [BLOCK_K, BLOCK_N]
        g = rk // GROUP
        s = tl.load(s_ptr + rn64[None, :] * stride_sn + g[:, None], mask=wmask, other=0.0).to(tl.float32)
        if BITS == 8:
            q = tl.load(w_ptr + rn64[None, :] * stride_wn + rk[:, None], mask=wmask, other=0).to(tl.float32)
            w = q * s
        else:
            byte = (rk // 32) * 16 + rk % 16
            shift = ((rk // 16) % 2) * 4
            b = tl.load(w_ptr + rn64[None, :] * stride_wn + byte[:, None], mask=wmask, other=0).to(tl.int32)
            q = ((b >> shift[:, None]) & 15).to(tl.float32)
            z = tl.load(z_ptr + rn64[None, :] * stride_sn + g[:, None], mask=wmask, other=0.0).to(tl.float32)
            w = (q - 8.0) * s + z
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x_ptr.dtype.element_ty), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm64[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class GemmPlan:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def plan_quant_gemm(*, m: int, interpret: bool) -> GemmPlan:
    """Interpreter: few, large programs. GPU: 16-row tiles for decode batches (tl.dot's minimum),
    64 for prefill chunks; 64x64 weight tiles, 4 warps, 3 stages (fits sm_80's shared memory)."""
    if interpret:
        return GemmPlan(min(128, max(16, triton.next_power_of_2(m))), 64, 128, 1, 1)
    return GemmPlan(16 if m <= 16 else 64, 64, 64, 4, 3)


def quant_gemm(*, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor | None, group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (unit last stride) -> y [M, N] in x's dtype. ``zeros`` given = int4, else int8."""
    check_device(x)
    m, k = x.shape
    n = qweight.shape[0]
    bits = 8 if zeros is None else 4
    if x.stride(1) != 1:
        x = x.contiguous()
    assert scales.shape == (n, -(-k // group_size)), (scales.shape, n, k, group_size)
    assert qweight.stride(1) == 1 and scales.stride(1) == 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    plan = plan_quant_gemm(m=m, interpret=interpreted())
    grid = (triton.cdiv(m, plan.block_m), triton.cdiv(n, plan.block_n))
    _quant_gemm_kernel[grid](
        x, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, y,
        m, n, k, x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        BITS=bits, GROUP=group_size, HAS_BIAS=bias is not None, BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, UPCAST=interpreted(),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=plan.num_warps, num_stages=plan.num_stages)
    return y
