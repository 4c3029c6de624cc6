"""LoRA shrink / expand for one adapter's rows of a flattened token batch (backend/lora/batch.py):

    shrink:  t[i, :]                      = x[rows[i], :] . A^T           t [n, r]
    expand:  y[rows[i], col0 : col0 + N] += scale * (t[i, :] . B^T)       in place, B [N, r]

One gathered GEMM serves both: row i of the product reads input row ``in_rows[i]`` (or i) and
writes/adds output row ``out_rows[i]`` (or i), columns from ``col0``. Grid ``(cdiv(n, BLOCK_M),
cdiv(N, BLOCK_N))``; a program walks K in BLOCK_K steps and accumulates ``tl.dot`` in fp32 (exact
fp32 products for fp32 activations, as the other kernels). An adapter's rows are distinct, so
the adds of one launch never race. Under the interpreter every load is fp32 and blocks are large.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import check_device, interpreted


@triton.jit
def _gather_gemm_kernel(
    x_ptr,          # [*, K], unit last stride
    in_rows_ptr,    # [M] int64 (GATHER)
    w_ptr,          # [N, K], unit last stride
    y_ptr,          # [*, *], unit last stride
    out_rows_ptr,   # [M] int64 (SCATTER)
    M, N, K, col0, scale,
    stride_xm, stride_wn, stride_ym,
    GATHER: tl.constexpr,
    SCATTER: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    src = tl.load(in_rows_ptr + rm, mask=m_ok, other=0) if GATHER else rm.to(tl.int64)
    dst = tl.load(out_rows_ptr + rm, mask=m_ok, other=0) if SCATTER else rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + src[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn64[None, :] * stride_wn + rk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x_ptr.dtype.element_ty), input_precision=DOT_PRECISION)
    acc = acc * scale
    ptrs = y_ptr + dst[:, None] * stride_ym + (col0 + rn64)[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _launch(x, w, y, *, in_rows, out_rows, m: int, col0: int, scale: float, accumulate: bool) -> None:
    n, k = w.shape
    if interpreted():
        bm, bn, bk, warps = min(128, max(16, triton.next_power_of_2(m))), 64, 128, 1
    else:
        bm, bn, bk, warps = (16 if m <= 16 else 64), 64, 32, 4
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    dummy = in_rows if in_rows is not None else out_rows
    _gather_gemm_kernel[grid](
        x, in_rows if in_rows is not None else dummy, w, y, out_rows if out_rows is not None else dummy,
        m, n, k, col0, float(scale), x.stride(0), w.stride(0), y.stride(0),
        GATHER=in_rows is not None, SCATTER=out_rows is not None, ACCUMULATE=accumulate,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, UPCAST=interpreted(),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps)


def lora_shrink(x: torch.Tensor, rows: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """x [T, K], rows [n] int64, A [r, K] -> t [n, r] fp32 (kept fp32 between the two GEMMs)."""
    check_device(x)
    t = torch.empty(rows.shape[0], a.shape[0], dtype=torch.float32, device=x.device)
    if rows.numel():
        _launch(x, a, t, in_rows=rows, out_rows=None, m=rows.shape[0], col0=0, scale=1.0, accumulate=False)
    return t


def lora_expand(t: torch.Tensor, b: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, *, col0: int,
                scale: float) -> None:
    """y[rows, col0:col0 + N] += scale * t . B^T in place; t [n, r], B [N, r], y unit last stride."""
    check_device(t)
    assert y.stride(1) == 1 and b.stride(1) == 1 and t.stride(1) == 1
    if rows.numel():
        _launch(t, b, y, in_rows=None, out_rows=rows, m=rows.shape[0], col0=col0, scale=scale, accumulate=True)
