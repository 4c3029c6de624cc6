"""kernels/csrc/lora_cpu.c alone: ``lora_apply`` adds each group's scale * (x A^T) B^T into its own
rows and column slices, as the torch path (backend/lora/batch.py LoRABatch.add) does; base rows are
left bit for bit. Built three ways: -march=native, x86-64-v3 (AVX2 + FMA, no AVX-512: an AVX2-only
host) and plain x86-64 (the generic vectors)."""
from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from backend.lora.adapter import TARGETS, LoRAAdapter
from backend.lora.batch import LoRABatch
from backend.lora.fused import CStep
from kernels import cpu

# odd sizes: K and N tails past the 8- and 16-wide vectors
H, Q, KV, INTER, LAYERS = 72, 72, 24, 100, 2
MODULES = {"qkv": (0, H, Q + 2 * KV), "o": (1, Q, H), "gate_up": (2, H, 2 * INTER), "down": (3, INTER, H)}
SHAPES = {"q_proj": (H, Q), "k_proj": (H, KV), "v_proj": (H, KV), "o_proj": (Q, H), "gate_proj": (H, INTER),
          "up_proj": (H, INTER), "down_proj": (INTER, H)}
ARCHS = {"native": "-march=native", "avx2": "-march=x86-64-v3", "generic": "-march=x86-64"}


def _load(arch: str):
    if platform.machine() != "x86_64" and arch != "native":
        pytest.skip("x86-64 builds only")
    path = cpu._build(cpu.SOURCE.with_name("lora_cpu.c"), ["-O3", ARCHS[arch], "-shared", "-fPIC"])
    if path is None:
        pytest.skip("no C compiler (or it does not know the -march)")
    lib = cpu.load_library(path)
    lib.lora_apply.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_int, ctypes.c_void_p]
    lib.lora_check.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.lora_rows_done.restype = ctypes.c_int64
    return lib


@pytest.fixture(scope="module", params=list(ARCHS))
def lib(request):
    return _load(request.param)


def adapter(name: str, rank: int, targets: list[str], seed: int) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    layers = [{t: (torch.randn(rank, SHAPES[t][0], generator=g), torch.randn(SHAPES[t][1], rank, generator=g))
               for t in targets} for _ in range(LAYERS)]
    return LoRAAdapter(name=name, path="-", rank=rank, scale=0.5 + seed / 8, uid=f"{name}@{seed}", layers=layers)


def batch(spans) -> tuple[LoRABatch, CStep]:
    lb = LoRABatch.build(spans, q_size=Q, kv_size=KV, intermediate=INTER)
    return lb, CStep(lb, hidden=H, q_size=Q, kv_size=KV, inter=INTER, num_layers=LAYERS)


ALL = list(TARGETS)
# ranks 8, 3 (odd: the last A row of a pair), 64 and 16; groups of 1, 2, 5 and 21 rows (row tiles of
# 4 plus tails, more than one 16-row shrink chunk), interleaved with base rows
A8, A3, A64, A16 = (adapter("a8", 8, ["q_proj", "v_proj"], 1), adapter("a3", 3, ALL, 2),
                    adapter("a64", 64, ALL, 3), adapter("a16", 16, ["gate_proj", "up_proj", "down_proj"], 4))
SPANS = [(None, 3), (A8, 1), (A64, 5), (None, 2), (A3, 2), (A8, 1), (A16, 21), (A64, 1), (None, 1)]


@pytest.mark.parametrize("module", list(MODULES))
def test_apply_equals_the_torch_path(lib, module):
    proj, k, n = MODULES[module]
    m = sum(c for _, c in SPANS)
    lb, cs = batch(SPANS)
    g = torch.Generator().manual_seed(11)
    for layer in range(LAYERS):
        x = torch.randn(m, k, generator=g)
        y0 = torch.randn(m, n, generator=g)
        want = y0.clone()
        lb.add(want, x, layer, module)
        got = y0.clone()
        assert lib.lora_apply(cs.address, layer, proj, x.data_ptr(), got.data_ptr(), 1, None) == 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        base = [0, 1, 2, 9, 10, 36]         # rows of no adapter: not one bit changed
        assert torch.equal(got[base], y0[base])
        assert not torch.equal(got, y0)      # (an adapter of every module is in SPANS)


def test_rows_counter_and_check(lib):
    _, cs = batch([(None, 2), (A8, 3), (A3, 1)])
    before = lib.lora_rows_done()
    x, y = torch.randn(6, H), torch.zeros(6, Q + 2 * KV)
    assert lib.lora_apply(cs.address, 0, 0, x.data_ptr(), y.data_ptr(), 1, None) == 0
    assert lib.lora_rows_done() - before == 4        # both groups target q/k/v
    x, y = torch.randn(6, INTER), torch.zeros(6, H)
    assert lib.lora_apply(cs.address, 0, 3, x.data_ptr(), y.data_ptr(), 1, None) == 0
    assert lib.lora_rows_done() - before == 5        # down: A3 only (A8 is q/v)
    assert lib.lora_check(cs.address, 6) == 0
    assert lib.lora_check(cs.address, 5) == -2       # row 5 past a 5-row step


def test_bf16_adapter_is_widened_exactly(lib):
    a = adapter("b", 8, ["o_proj"], 5)
    a16 = LoRAAdapter(name="b", path="-", rank=8, scale=a.scale, uid="b@bf16",
                      layers=[{t: (x.bfloat16(), y.bfloat16()) for t, (x, y) in la.items()} for la in a.layers])
    ref = LoRAAdapter(name="b", path="-", rank=8, scale=a.scale, uid="b@f32",
                      layers=[{t: (x.float(), y.float()) for t, (x, y) in la.items()} for la in a16.layers])
    x, y0 = torch.randn(3, Q), torch.randn(3, H)
    out = []
    for ad in (a16, ref):
        _, cs = batch([(ad, 3)])
        y = y0.clone()
        assert lib.lora_apply(cs.address, 1, 1, x.data_ptr(), y.data_ptr(), 1, None) == 0
        out.append(y)
    assert torch.equal(out[0], out[1])
