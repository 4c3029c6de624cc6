"""Compile every kernel variant the launch plans produce for CUDA targets, without a GPU.

Triton ships ptxas, so ``triton.compile`` can go from Python to a cubin on a CPU-only
machine: this catches what the interpreter cannot (type errors in loops, tl.dot shape
limits, shared memory over the target's limit).  Run it in a process where
TRITON_INTERPRET is unset (test_cuda_compile.py does):

    .venv/bin/python tests/kernels/cuda_compile.py [sm ...]
"""
from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import attention, kv_store, rmsnorm, rotary  # noqa: E402
from kernels.launch import plan_attention, plan_store  # noqa: E402

SHARED_LIMIT = {80: 166912, 89: 101376, 90: 232448}   # max dynamic shared memory per block
TL = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# (dtype, num_tokens, num_seqs, q_heads, kv_heads, head_dim, num_kv_splits)
ATTENTION_CASES = [
    (torch.bfloat16, 64, 64, 32, 8, 128, 1),    # decode batch, Llama-8B-like heads
    (torch.bfloat16, 4, 4, 12, 12, 64, 8),      # split-KV decode, MHA, bench-110m-like
    (torch.bfloat16, 700, 5, 32, 4, 128, 1),    # mixed prefill + decodes, G=8
    (torch.float16, 300, 3, 16, 16, 64, 1),
    (torch.float32, 300, 3, 32, 4, 128, 1),     # fp32: exact products, smaller tile
    (torch.float32, 2, 2, 8, 1, 128, 4),
]


def signature(fn, constexprs: dict, pointers: dict, floats=()) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = "*" + pointers[name]
        else:
            sig[name] = "fp32" if name in floats else "i32"
    return sig


def compile_one(fn, constexprs, pointers, target, floats=(), **options):
    src = ASTSource(fn, signature(fn, constexprs, pointers, floats), constexprs)
    kernel = triton.compile(src, target=target, options=options)
    return kernel.metadata.shared


def main(arches: list[int]) -> int:
    failures = 0
    for arch in arches:
        target = GPUTarget("cuda", arch, 32)
        jobs = []
        for dtype, tokens, seqs, hq, hkv, d, splits in ATTENTION_CASES:
            plan = plan_attention(dtype=dtype, num_tokens=tokens, num_seqs=seqs, num_q_heads=hq,
                                  num_kv_heads=hkv, head_dim=d, block_size=16, max_len=4096,
                                  num_kv_splits=splits, interpret=False, num_sms=132)
            t = TL[dtype]
            ptrs = dict(q_ptr=t, k_cache_ptr=t, v_cache_ptr=t, out_ptr=t, part_out_ptr="fp32",
                        part_lse_ptr="fp32", block_tables_ptr="i32", cu_seqlens_q_ptr="i32",
                        seq_lens_ptr="i32")
            jobs.append((f"attention {t} G={hq // hkv} D={d} M={plan.constexprs['BLOCK_M']} "
                         f"tile={plan.constexprs['TILE']} splits={splits}",
                         attention._paged_attention_kernel, plan.constexprs, ptrs, ("qk_scale",),
                         dict(num_warps=plan.num_warps, num_stages=plan.num_stages)))
            if plan.merge_constexprs:
                jobs.append((f"merge {t} splits={splits} D={d}", attention._merge_splits_kernel,
                             dict(plan.merge_constexprs, INTERPRET=False),
                             dict(out_ptr=t, part_out_ptr="fp32", part_lse_ptr="fp32"), (),
                             dict(num_warps=4)))
        for dtype in (torch.bfloat16, torch.float32):
            _, consts = plan_store(num_tokens=100, num_kv_heads=8, head_dim=128, block_size=16,
                                   interpret=False)
            t = TL[dtype]
            jobs.append((f"store {t}", kv_store._store_kv_kernel, dict(consts, INTERPRET=False),
                         dict(key_ptr=t, value_ptr=t, k_cache_ptr=t, v_cache_ptr=t, slot_ptr="i64"),
                         (), dict(num_warps=4)))
            jobs.append((f"rms_norm {t} hidden=4096", rmsnorm._rms_norm_kernel,
                         dict(HAS_RESIDUAL=True, BLOCK_T=4, BLOCK_H=4096, INTERPRET=False),
                         dict(x_ptr=t, res_ptr=t, w_ptr=t, out_ptr=t, res_out_ptr=t), ("eps",),
                         dict(num_warps=4)))
            jobs.append((f"rope {t} 32/8 heads dim 128", rotary._rope_kernel,
                         dict(HALF=64, HALF_PAD=64, HEADS_PAD=32, BLOCK_T=4, INTERPRET=False),
                         dict(q_ptr=t, k_ptr=t, cos_ptr="fp32", sin_ptr="fp32", pos_ptr="i64"), (),
                         dict(num_warps=4)))
        for name, fn, consts, ptrs, floats, options in jobs:
            try:
                shared = compile_one(fn, consts, ptrs, target, floats, **options)
                ok = shared <= SHARED_LIMIT.get(arch, 101376)
                print(f"sm_{arch} {name}: shared {shared} B {'ok' if ok else 'OVER LIMIT'}", flush=True)
                failures += not ok
            except Exception as exc:  # report every variant, then fail
                print(f"sm_{arch} {name}: FAILED {type(exc).__name__}: {exc}", flush=True)
                failures += 1
    return failures


if __name__ == "__main__":
    sys.exit(1 if main([int(a) for a in sys.argv[1:]] or [90]) else 0)
