"""QuantLinear: a weight-only quantized stand-in for :class:`backend.model.llama.Linear`.

Its tensors are parameters (``requires_grad=False``) named as they are on disk (``qweight``,
``scales``, ``zeros``, ``bias``), so the loader fills them like float weights, fused row slices
included; ``param_dtypes`` tells the loader which dtype each one keeps (the bias alone follows the
model dtype). The forward pass picks the kernel by device:

    CPU   backend/quant/cpu.py: the C kernels (int8 per channel from 8 rows: int16 activations),
          dequantize + BLAS for int4 / grouped int8 above 32 rows
    CUDA  kernels/quant_gemm.py: OpenAI-Triton W8A16 / W4A16 (dequantize in registers, fp32 acc)
    else  dequantize + F.linear (the reference; also the path with no C compiler)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend.quant import layout
from backend.quant.layout import QuantWeight


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, method: str, group_size: int):
        super().__init__()
        if method not in ("int8", "int4"):
            raise ValueError(f"QuantLinear method must be int8 or int4 (got {method!r})")
        layout.check_group_size(method, group_size)
        self.in_features, self.out_features = in_features, out_features
        self.method, self.group_size = method, group_size
        ng = layout.num_groups(in_features, group_size)
        if method == "int8":
            self.qweight = _param(torch.empty(out_features, in_features, dtype=torch.int8))
            self.zeros = None
        else:
            kb = layout.num_groups(in_features, layout.INT4_BLOCK)
            self.qweight = _param(torch.empty(out_features, kb * 16, dtype=torch.uint8))
            self.zeros = _param(torch.empty(out_features, ng, dtype=torch.float16))
        self.scales = _param(torch.empty(out_features, ng, dtype=torch.float16))
        self.bias = _param(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None     # cpu.pack's buffer (pack()), not a parameter
        self._packed_key: tuple | None = None
        self.param_dtypes = {"qweight": self.qweight.dtype, "scales": torch.float16, "zeros": torch.float16}

    @classmethod
    def from_quant(cls, qw: QuantWeight, bias: torch.Tensor | None) -> "QuantLinear":
        with torch.device("meta"):
            mod = cls(qw.in_features, qw.out_features, bias is not None, qw.method, qw.group_size)
        mod.qweight, mod.scales = _param(qw.qweight), _param(qw.scales)
        mod.zeros = None if qw.zeros is None else _param(qw.zeros)
        mod.bias = None if bias is None else _param(bias)
        return mod

    def pack(self) -> torch.Tensor | None:
        """The packed copy of int8 groups of 32 for the CPU kernels (backend/quant/cpu.py ``pack``),
        made again whenever ``qweight`` / ``scales`` were replaced or written since (the loader
        fills them after construction); None where no packed layout applies."""
        if self.qweight.device.type != "cpu" or self.qweight.is_meta:
            return None
        key = (self.qweight.data_ptr(), self.qweight._version, self.scales.data_ptr(), self.scales._version)
        if key != self._packed_key:
            from backend.quant import cpu
            self.packed, self._packed_key = cpu.pack(self.method, self.qweight, self.scales, self.group_size,
                                                     self.in_features), key
        return self.packed

    def c_weight(self) -> tuple[int, int]:
        """(weight address, G) for w8_gemm / w4_gemm: the packed buffer with cpu.PACKED_G where there
        is one, else ``qweight`` and the group size (the fused step's QW)."""
        from backend.quant import cpu
        packed = self.pack()
        if packed is not None:
            return packed.data_ptr(), cpu.PACKED_G
        return self.qweight.data_ptr(), self.group_size

    def quant_weight(self) -> QuantWeight:
        return QuantWeight(self.method, self.qweight, self.scales, self.zeros, self.group_size, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if x.device.type == "cpu":
            from backend.quant import cpu
            if cpu.library() is not None:
                y = cpu.gemm(x2.float(), self.method, self.qweight, self.scales, self.zeros,
                             self.group_size, k, None if self.bias is None else self.bias.float(),
                             packed=self.pack())
                return y.to(x.dtype).reshape(*lead, -1)
        elif x.device.type == "cuda":
            import kernels
            if kernels.triton_available(x.device):
                from kernels.quant_gemm import quant_gemm
                y = quant_gemm(x=x2, qweight=self.qweight, scales=self.scales, zeros=self.zeros,
                               group_size=self.group_size, bias=self.bias)
                return y.reshape(*lead, -1)
        w = layout.dequantize(self.quant_weight()).to(x.dtype)
        return F.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, {self.method}, "
                f"group={self.group_size}, bias={self.bias is not None}")
