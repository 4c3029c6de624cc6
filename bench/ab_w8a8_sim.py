"""W8A8 experiment (issue 28, rejected): greedy agreement with activations fake-quantized in groups of G.

    PYTHONPATH=. python bench/ab_w8a8_sim.py G      (0: int16-like, no activation rounding)
"""
import sys, os, torch
import torch.nn.functional as F
os.environ["TRITON_LLM_FUSED_DECODE"] = "0"
from backend.quant.linear import QuantLinear
from backend.quant import layout
from bench.int8_agreement import generate, prefix_share
from load.bench_quant import prompts
ga = int(sys.argv[1]); mode = sys.argv[2] if len(sys.argv) > 2 else "sym"
cache = {}
def fwd(self, x):
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).float()
    if ga:
        g = x2.view(x2.shape[0], -1, ga)
        amax = g.abs().amax(-1, keepdim=True)
        idv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        q = torch.round(g * idv)
        x2 = (q * (amax / 127)).view_as(x2)
    w = cache.get(id(self))
    if w is None:
        w = cache[id(self)] = layout.dequantize(self.quant_weight()).float()
    return F.linear(x2, w, None if self.bias is None else self.bias.float()).reshape(*lead, -1)
QuantLinear.forward = fwd
texts = prompts(12)
ref, _ = generate("models/default", "none", texts, 48, 1, None)
got, _ = generate("models/default", "int8", texts, 48, 1, None)
print(ga, sum(prefix_share(r, g) for r, g in zip(ref, got)) / len(ref))
