"""Small @triton.jit helpers shared by the kernels."""
import triton
import triton.language as tl


@triton.jit
def cast_rtne(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> ``dtype`` rounding to nearest even, as a GPU does.

    Triton's interpreter truncates fp32 -> bf16 casts, so there the rounding is done by hand on
    the bits: add 0x7FFF plus the lowest kept bit, then drop the low 16 bits."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
