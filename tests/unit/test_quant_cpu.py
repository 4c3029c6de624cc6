"""The CPU quantized GEMMs (backend/quant/csrc/) against dequantize-then-matmul.

Tolerance: 1e-5 of max |reference| for the weight-only loops (fp32 products; only the summation
order differs from BLAS). int8 per channel at 1 row and from A16_MIN_M rows on (and groups of 32
from A16_MIN_M rows on) quantizes activations to int16 (one scale per row): there the bound is the rounding of x, per output
|dy[m, n]| <= sum_k |W[n, k]| * max|x[m]| / (2 Q), Q = min(32767, (2^31 - 1) / (127 K)), plus the
same 1e-5 for fp32 rounding. Shapes are odd on purpose: K not a multiple of 8, 16, 32 or the group,
N not a multiple of anything, M = 1 (decode), 2..5, 8, 15, 29 (the 8 / 4 / 1..3-row tiles and their
remainders), 300 (prefill: dequantize + BLAS, or the int16 kernel for int8 per channel).
"""
import pytest
import torch

from backend.quant import cpu, layout
from backend.quant.linear import QuantLinear

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="no C compiler: torch fallback only")

SHAPES = [(1, 37, 100), (2, 37, 100), (3, 19, 77), (5, 64, 200), (8, 21, 100), (15, 40, 77), (16, 33, 576),
          (29, 33, 200), (300, 70, 200)]


Z = bool(cpu.library() and cpu.library().w8_has_avx512())   # groups of 32: csrc/w8_avx512.c


def takes_a16(m: int, k: int, group: int | None) -> bool:
    """Where w8_gemm quantizes activations to int16: groups of 32 (K a multiple of 32) on AVX-512BW
    hosts at every M; else 1 row (the 4-stream GEMV) and A16_MIN_M+ rows, per channel or in groups
    of 32 (K > 32); 2 rows per channel (the GEMV on both rows)."""
    if Z and group == 32 and k % 32 == 0:
        return True
    return ((m == 1 or m >= cpu.A16_MIN_M) and (group is None or (group == 32 and k % 32 == 0 and k > 32))
            or (m == 2 and group is None))


def a16_bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-output bound of int8 x int16-activation GEMMs against fp32 activations (module doc)."""
    k = x.shape[1]
    q = min(32767, (2**31 - 1) // (127 * k))
    return w.abs().sum(1)[None, :] * x.abs().amax(1, keepdim=True) / (2 * q) + 1e-5 * ref.abs().max()


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("method,group", [("int8", None), ("int8", 32), ("int4", 32), ("int4", 64)])
def test_cpu_gemm_matches_dequantize_then_matmul(m, n, k, method, group):
    torch.manual_seed(m * 1000 + k)
    w, x, bias = torch.randn(n, k), torch.randn(m, k), torch.randn(n)
    qw = layout.quantize_int8(w, group) if method == "int8" else layout.quantize_int4(w, group)
    ref = torch.nn.functional.linear(x, layout.dequantize(qw), bias)
    y = cpu.gemm(x, method, qw.qweight, qw.scales, qw.zeros, qw.group_size, k, bias)
    if method == "int8" and takes_a16(m, k, group):                                  # int16 activations
        assert ((y - ref).abs() <= a16_bound(x, layout.dequantize(qw), ref)).all()
    else:
        assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(cpu.dequantize(method, qw.qweight, qw.scales, qw.zeros, qw.group_size, k),
                       layout.dequantize(qw))


def test_cpu_gemm_strided_rows_and_threads():
    torch.manual_seed(1)
    w, big = torch.randn(40, 96), torch.randn(3, 200)
    x = big[:, 10:106]                                   # row stride 200, unit last stride
    qw = layout.quantize_int4(w, 32)
    ref = torch.nn.functional.linear(x, layout.dequantize(qw))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            y = cpu.gemm(x, "int4", qw.qweight, qw.scales, qw.zeros, 32, 96, None)
            assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    finally:
        torch.set_num_threads(before)


def _plain_int8(w: torch.Tensor, group: int) -> torch.Tensor:
    """absmax / 127 scales, no search: what the searched scales must not do worse than."""
    n, k = w.shape
    wg = torch.nn.functional.pad(w, (0, -k % group)).view(n, -1, group)
    s = (wg.abs().amax(-1, keepdim=True) / 127).half().float()
    return (torch.round(wg / s.clamp_min(1e-30)).clamp(-127, 127) * s).view(n, -1)[:, :k]


@pytest.mark.parametrize("group", [None, 32, 48])
def test_quantization_error_is_bounded(group):
    """int8: the searched scale's squared error per group is at most absmax / 127's; unclipped
    values are within scale / 2, clipped ones (|w| > 127 s) at most 5 % of the group's absmax
    (the grid starts at 0.95)."""
    torch.manual_seed(2)
    w = torch.randn(64, 100)
    w[3, :40] = 0                                  # an all-zero group: scale 0, q 0
    q8 = layout.quantize_int8(w, group)
    g = q8.group_size
    s = q8.scales.float().repeat_interleave(g, 1)[:, :100]
    dq, plain = layout.dequantize(q8), _plain_int8(w, g)
    err = lambda d: torch.nn.functional.pad((d - w).square(), (0, -100 % g)).view(64, -1, g).sum(-1)  # noqa: E731
    assert (err(dq) <= err(plain) * (1 + 1e-5) + 1e-12).all() and err(dq).sum() < err(plain).sum()
    inside = w.abs() <= 127 * s
    assert ((dq - w).abs()[inside] <= s[inside] / 2 + 1e-6).all()
    amax = torch.nn.functional.pad(w.abs(), (0, -100 % g)).view(64, -1, g).amax(-1).repeat_interleave(g, 1)[:, :100]
    assert ((dq - w).abs()[~inside] <= 0.0501 * amax[~inside]).all()
    assert (q8.qweight[3, :32] == 0).all() and (dq[3, :32] == 0).all()


@pytest.mark.parametrize("shape,group", [((70, 576), 32), ((9, 100), 32), ((5, 77), 77), ((3, 40), 64)])
def test_int8_quantize_c_equals_reference(shape, group):
    """csrc/w8_quantize.c runs layout.quantize_int8's scale search: the same scales and bytes."""
    torch.manual_seed(7)
    w = torch.randn(*shape) * 0.05
    w[0, :32] = 0
    a, b = layout.quantize_int8(w, group), layout.quantize_int8(w, group, reference=True)
    assert a.scales.equal(b.scales) and a.qweight.equal(b.qweight)


def test_int8_quantize_keeps_q8_0_blocks():
    """A group that already is q * d with max|q| = 127 (a GGUF Q8_0 block) keeps d and q exactly."""
    torch.manual_seed(8)
    q = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    q[:, ::32] = 127
    d = (torch.rand(16, 2) * 0.01 + 1e-3).half()
    w = q.float() * d.float().repeat_interleave(32, 1)
    got = layout.quantize_int8(w, 32)
    assert got.scales.equal(d) and got.qweight.equal(q)


def test_int4_quantization_error_is_bounded():
    """int4: within half a grid step of each group."""
    torch.manual_seed(2)
    w = torch.randn(64, 100)
    q4 = layout.quantize_int4(w, 32)
    step = q4.scales.float().repeat_interleave(32, 1)[:, :100]
    assert ((layout.dequantize(q4) - w).abs() <= step / 2 + 2e-3 * w.abs().max()).all()
    assert layout.unpack_int4(layout.pack_int4(torch.arange(100).remainder(16).to(torch.uint8).repeat(3, 1)),
                              100).equal(torch.arange(100).remainder(16).to(torch.uint8).repeat(3, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_forward_on_cpu(dtype):
    torch.manual_seed(3)
    w, bias, x = torch.randn(24, 64), torch.randn(24), torch.randn(2, 3, 64)
    mod = QuantLinear.from_quant(layout.quantize_int4(w, 32), bias)
    ref = torch.nn.functional.linear(x, layout.dequantize(mod.quant_weight()), bias)
    y = mod.forward(x.to(dtype))
    assert y.dtype == dtype and y.shape == (2, 3, 24)
    assert (y.float() - ref).abs().max() <= (1e-5 if dtype == torch.float32 else 3e-2) * ref.abs().max()


@pytest.mark.parametrize("m,n,k", [(1, 5, 16), (4, 9, 100), (8, 21, 100), (13, 40, 576), (64, 30, 1536),
                                   (9, 7, 9000), (2, 9, 32), (3, 17, 96), (7, 6, 17024), (1, 5, 17024)])
@pytest.mark.parametrize("group", [None, 32])
def test_int16_activation_kernel_within_its_bound(m, n, k, group):
    """w8_gemm_a16 for every M (tiles 4 x 2 / 4 x 1 for groups of 32, all remainders; K = 9000: Q
    drops to 1878 so the int32 sums cannot overflow; K = 100 with groups: not a multiple of 32, the
    weight-only loops), rows scaled 1e-3..1e3 apart and one all-zero row; the weight-only loops on the
    same input stay at fp32 accuracy. Groups of 32 on AVX-512BW hosts: the 512-bit kernel ``z`` too
    (every M, 4 x 4 tiles and their remainders)."""
    torch.manual_seed(k + m)
    w, x, bias = torch.randn(n, k), torch.randn(m, k), torch.randn(n)
    x *= torch.logspace(-3, 3, m)[:, None]
    x[m // 2] = 0
    qw = layout.quantize_int8(w, group)
    dq = layout.dequantize(qw)
    ref = torch.nn.functional.linear(x, dq, bias)
    z = ("z",) if Z and group == 32 and k % 32 == 0 else ()
    for kernel in ("a16", "f32a", "blas", *z):
        y = cpu.gemm(x, "int8", qw.qweight, qw.scales, None, qw.group_size, k, bias, kernel=kernel)
        if kernel in ("a16", "z"):
            assert ((y - ref).abs() <= a16_bound(x, dq, ref)).all()
            assert torch.equal(y[m // 2], bias)                  # a zero row: exactly the bias
        else:
            assert ((y - ref).abs() <= 1e-5 * ref.abs().amax(1, keepdim=True) + 1e-6).all()


GEMV_K = [(9, None), (16, None), (17, None), (77, None), (576, None), (1537, None), (9000, None),
          (64, 32), (96, 32), (160, 32), (576, 32), (9024, 32)]


@pytest.mark.parametrize("n", [1, 3, 4, 7, 9, 64, 101])
@pytest.mark.parametrize("m,k,group", [(1, k, g) for k, g in GEMV_K] + [(2, k, g) for k, g in GEMV_K if g is None]
                         + ([(m, k, 32) for m in (2, 3, 4) for k in (64, 576, 9024)] if Z else []))
def test_one_row_int16_gemv_against_float64(m, n, k, group):
    """w8_gemv_a16 (1 row; per channel 4 weight rows from the 4 quarters of N per pass, the N % 4
    rest one by one, K % 16 tails scalar; groups of 32 row by row in that order, ng % 4 tail groups)
    and w8_gemv2_a16 (2 rows, per channel; rows given with a stride, each row its own scale)
    (on AVX-512BW hosts, groups of 32 at 1-4 rows: csrc/w8_avx512.c's GEMV and tiles, 4 weight
    rows per pass, K up to 9024: scales beyond the stack buffer) against dequantize-then-matmul in
    float64, within the int16 bound, with 1 and 2 threads giving
    the same bits; a zero row gives exactly the bias."""
    torch.manual_seed(n * 7 + k + m)
    w, bias = torch.randn(n, k), torch.randn(n)
    qw = layout.quantize_int8(w, group)
    assert takes_a16(m, k, group)
    dq = layout.dequantize(qw)
    before = torch.get_num_threads()
    try:
        for scale in (1e-3, 1.0, 1e3):
            x = (torch.randn(m, k + 3) * scale * torch.logspace(0, 2, m)[:, None])[:, 2:k + 2]   # row stride k + 3
            x[:, k // 2] *= 50                                      # an outlier sets each row's scale
            ref = (x.double() @ dq.double().T + bias.double()).float()
            ys = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                ys.append(cpu.gemm(x, "int8", qw.qweight, qw.scales, None, qw.group_size, k, bias))
            assert torch.equal(ys[0], ys[1])
            assert ((ys[0] - ref).abs() <= a16_bound(x, dq, ref)).all()
        zero = cpu.gemm(torch.zeros(m, k), "int8", qw.qweight, qw.scales, None, qw.group_size, k, bias)
        assert all(torch.equal(row, bias) for row in zero)
    finally:
        torch.set_num_threads(before)


def test_int8_routing_and_switch():
    """w8_gemm (also what the fused decode step calls) takes int16 activations at 1 row per channel
    and from A16_MIN_M rows on (per channel and groups of 32); w8_set_a16_min_m(0) keeps the
    weight-only loops everywhere."""
    torch.manual_seed(5)
    k = 200
    qw, q32 = layout.quantize_int8(torch.randn(30, k)), layout.quantize_int8(torch.randn(30, k + 8), 32)
    q64 = layout.quantize_int8(torch.randn(30, k + 8), 64)
    q6 = layout.quantize_int8(torch.randn(30, 192), 32)
    lib = cpu.library()
    assert lib.w8_a16_min_m() == cpu.A16_MIN_M
    for m in (1, 2, cpu.A16_MIN_M - 1, cpu.A16_MIN_M, 40):                    # 1 and 8+ rows: int16
        x = torch.randn(m, k)
        x8 = torch.randn(m, k + 8)                                            # K = 208: 6.5 groups of 32
        run = lambda q, kern: cpu.gemm(x if q is qw else x8, "int8", q.qweight, q.scales, None, q.group_size,  # noqa: E731
                                       q.in_features, None, kernel=kern)
        want = "a16" if takes_a16(m, k, None) else "f32a"
        assert torch.equal(run(qw, None), run(qw, want)) and torch.equal(run(qw, "c"), run(qw, want))
        want32 = "a16" if takes_a16(m, k + 8, 32) else "f32a"                # GGUF Q8_0 groups of 32 too,
        assert torch.equal(run(q32, "c"), run(q32, want32))                   # at the same M
        x6 = torch.randn(m, 192)                                              # K = 192: 6 whole groups
        want6 = ("z" if Z else "a16") if takes_a16(m, 192, 32) else "f32a"
        assert torch.equal(cpu.gemm(x6, "int8", q6.qweight, q6.scales, None, 32, 192, None, kernel="c"),
                           cpu.gemm(x6, "int8", q6.qweight, q6.scales, None, 32, 192, None, kernel=want6))
        if m > cpu.SMALL_M and Z:                                             # torch path: "z" at every M
            assert torch.equal(cpu.gemm(x6, "int8", q6.qweight, q6.scales, None, 32, 192, None),
                               cpu.gemm(x6, "int8", q6.qweight, q6.scales, None, 32, 192, None, kernel="z"))
        assert torch.equal(run(q64, "c"), run(q64, "f32a"))                   # other groups: weight-only
        assert not torch.equal(run(qw, "a16"), run(qw, "f32a"))
        if m > cpu.SMALL_M:                                                   # torch path: groups dequantize + BLAS
            assert torch.equal(run(q32, None), run(q32, "blas"))
    lib.w8_set_a16_min_m(0)                                                   # the weight-only numerics
    try:
        for m in (1, 16):
            x = torch.randn(m, k)
            assert torch.equal(cpu.gemm(x, "int8", qw.qweight, qw.scales, None, k, k, None),
                               cpu.gemm(x, "int8", qw.qweight, qw.scales, None, k, k, None, kernel="f32a"))
    finally:
        lib.w8_set_a16_min_m(cpu.A16_MIN_M)
