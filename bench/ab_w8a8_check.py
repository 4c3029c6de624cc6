"""W8A8 experiment (issue 28, rejected): the kernel against its torch reference, and batch invariance.

    PYTHONPATH=. python bench/ab_w8a8_check.py
"""
import time, torch
from backend.quant import cpu, layout
torch.manual_seed(0)
def ref(x, q, s, bias=None):
    M,K = x.shape; N = q.shape[0]; ng = K//32
    xs = x.view(M, ng, 32)
    amax = xs.abs().amax(-1)
    idv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xs * idv[..., None])
    sa = amax / 127.0
    isum = torch.einsum("mgk,ngk->mng", xq.double(), q.view(N, ng, 32).double())
    sc = (s.float()[None] * sa[:, None]).double()   # fp32 product
    y = (isum * sc).sum(-1)
    return y if bias is None else y + bias.double()
for (n,k) in [(960,576),(3072,576),(576,1536),(100,64)]:
    w = torch.randn(n,k)*0.05
    qw = layout.quantize_int8(w, 32)
    pk = cpu.pack("int8", qw.qweight, qw.scales, 32, k, activations="int8")
    for m in [1,2,7,16,64]:
        x = torch.randn(m,k)
        y = cpu.gemm(x, "int8", qw.qweight, qw.scales, None, 32, k, None, packed=pk)
        r = ref(x, qw.qweight, qw.scales)
        err = (y.double()-r).abs().max().item(); mag = r.abs().max().item()
        # batch invariance
        y1 = cpu.gemm(x[-1:].contiguous(), "int8", qw.qweight, qw.scales, None, 32, k, None, packed=pk)
        print(n,k,m, f"{err/mag:.2e}", torch.equal(y1[0], y[-1]))
