"""Weight-only quantization (issue 16): int8 per output channel, int4 group-wise.

    layout.py   the on-disk/in-memory layouts, quantize / dequantize (the torch reference)
    linear.py   QuantLinear: the module that replaces a model Linear (CPU C kernel, CUDA Triton)
    apply.py    swap the decoder's Linear layers at load time; what was quantized, weight bytes
    cpu.py      ctypes wrappers of csrc/*.c (built through kernels/cpu.py's cache)
    gguf.py     GGUF Q8_0 / Q4_0 / Q4_1 blocks -> our layouts, without going through fp32

docs/quantization.md has the design and the measurements.
"""
