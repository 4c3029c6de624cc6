"""W8A16 / W4A16 Triton GEMM against dequantize-then-matmul (interpreter on CPU, native on CUDA),
and the kernel compiled for sm_80 / sm_90 with Triton's ptxas (no GPU needed).

Tolerances, relative to max |reference|: fp32 activations 1e-5 (exact fp32 products, only the
summation order differs); bf16 activations 2e-2 (x and the dequantized weight rounded to bf16 on
a GPU; the interpreter computes in fp32 and lands well inside it).
"""
import os
import subprocess
import sys

import pytest
import torch

from backend.quant import layout

HERE = os.path.dirname(os.path.abspath(__file__))
# (M, N, K, method, group): K never a multiple of the group; M = 1 (decode) and 300 (prefill)
CASES = [(1, 37, 100, "int8", None), (300, 70, 200, "int8", None), (1, 37, 100, "int8", 32),
         (1, 37, 100, "int4", 32), (300, 70, 200, "int4", 64), (5, 64, 77, "int4", 32)]


def _quant(w, method, group):
    if method == "int8":
        return layout.quantize_int8(w, group)
    return layout.quantize_int4(w, group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,method,group", CASES)
def test_quant_gemm_matches_dequantize_then_matmul(triton_device, dtype, m, n, k, method, group):
    from kernels.quant_gemm import quant_gemm

    w, x, bias = torch.randn(n, k), torch.randn(m, k), torch.randn(n)
    qw = _quant(w, method, group)
    ref = torch.nn.functional.linear(x.to(dtype).float(), layout.dequantize(qw), bias)
    dev = triton_device
    y = quant_gemm(x=x.to(dtype).to(dev), qweight=qw.qweight.to(dev), scales=qw.scales.to(dev),
                   zeros=None if qw.zeros is None else qw.zeros.to(dev), group_size=qw.group_size,
                   bias=bias.to(dev))
    assert y.dtype == dtype and y.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (y.float().cpu() - ref).abs().max().item()
    assert err <= tol * ref.abs().max().item(), err


def test_quant_gemm_empty_batch(triton_device):
    from kernels.quant_gemm import quant_gemm

    qw = layout.quantize_int4(torch.randn(8, 64), 32)
    y = quant_gemm(x=torch.empty(0, 64, device=triton_device), qweight=qw.qweight.to(triton_device),
                   scales=qw.scales.to(triton_device), zeros=qw.zeros.to(triton_device), group_size=32)
    assert y.shape == (0, 8)


def test_quant_gemm_compiles_for_cuda():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__, "80", "90"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count(" ok") == 16, proc.stdout


def _compile_all(arches: list[int]) -> int:
    """Every plan variant (decode / prefill tiles) x int8/int4 x bf16/fp16/fp32 x bias."""
    sys.path.insert(0, HERE)
    from cuda_compile import SHARED_LIMIT, TL, compile_one
    from triton.backends.compiler import GPUTarget

    from kernels import quant_gemm as qg

    failures = 0
    for arch in arches:
        for m in (1, 300):
            plan = qg.plan_quant_gemm(m=m, interpret=False)
            for bits in (8, 4):
                for dtype in (torch.bfloat16, torch.float16) if bits == 4 else (torch.bfloat16, torch.float32):
                    t = TL[dtype]
                    consts = dict(BITS=bits, GROUP=32 if bits == 4 else 4096, HAS_BIAS=dtype != torch.float32,
                                  BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
                                  UPCAST=False, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32")
                    ptrs = dict(x_ptr=t, w_ptr="i8" if bits == 8 else "u8", s_ptr="fp16", z_ptr="fp16",
                                b_ptr=t, y_ptr=t)
                    name = f"quant_gemm w{bits} {t} M={plan.block_m}"
                    try:
                        shared = compile_one(qg._quant_gemm_kernel, consts, ptrs, GPUTarget("cuda", arch, 32),
                                             num_warps=plan.num_warps, num_stages=plan.num_stages)
                        ok = shared <= SHARED_LIMIT.get(arch, 101376)
                        print(f"sm_{arch} {name}: shared {shared} B {'ok' if ok else 'OVER LIMIT'}", flush=True)
                        failures += not ok
                    except Exception as exc:  # report every variant, then fail
                        print(f"sm_{arch} {name}: FAILED {type(exc).__name__}: {exc}", flush=True)
                        failures += 1
    return failures


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    sys.exit(1 if _compile_all([int(a) for a in sys.argv[1:]] or [90]) else 0)
