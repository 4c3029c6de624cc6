"""W8A8 experiment (issue 28, rejected): SmoothQuant-style per-channel smoothing (alpha) calibrated on
corpus lines 13-29, then W8A8 in groups of G, greedy agreement with fp32 on lines 1-12.

    PYTHONPATH=. python bench/ab_w8a8_smooth.py G ALPHA qkv_proj,gate_up_proj,down_proj,o_proj,head
"""
import sys, os, torch
import torch.nn.functional as F
os.environ["TRITON_LLM_FUSED_DECODE"] = "0"
from backend.quant.linear import QuantLinear
from backend.quant import layout
from bench.int8_agreement import generate, prefix_share
from load.bench_quant import prompts
ga = int(sys.argv[1]); alpha = float(sys.argv[2]); which = sys.argv[3].split(",")
cal = {}; phase = ["cal"]; wcache = {}
def quant_act(x2, g):
    gg = x2.view(x2.shape[0], -1, g)
    amax = gg.abs().amax(-1, keepdim=True)
    idv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    return (torch.round(gg * idv) * (amax / 127)).view_as(x2)
def fwd(self, x):
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).float()
    key = id(self)
    if phase[0] == "cal":
        m = x2.abs().amax(0)
        cal[key] = torch.maximum(cal[key], m) if key in cal else m
        w = layout.dequantize(self.quant_weight()).float()
    else:
        if key not in wcache:
            w0 = layout.dequantize(self.quant_weight()).float()   # int8 weights dequantized: re-quantize after smoothing
            name = self.tag
            if name in which and alpha > 0:
                s = (cal[key].clamp_min(1e-5) ** alpha) / (w0.abs().amax(0).clamp_min(1e-5) ** (1 - alpha))
            else:
                s = torch.ones(k)
            wq = layout.dequantize(layout.quantize_int8(w0 * s, 32)).float()
            wcache[key] = (s, wq)
        s, w = wcache[key]
        x2 = quant_act(x2 / s, ga)
    return F.linear(x2, w, None if self.bias is None else self.bias.float()).reshape(*lead, -1)
QuantLinear.forward = fwd
import backend.quant.apply as apply
orig = apply.finish_load
def fl(model, *a, **k):
    orig(model, *a, **k)
    for layer in model.model.layers:
        for path in apply.PROJECTIONS:
            pn, attr = path.split(".")
            getattr(getattr(layer, pn), attr).tag = attr
    if model.lm_head_q is not None: model.lm_head_q.tag = "head"
apply.finish_load = fl
from backend import LLM, SamplingParams
texts = prompts(12)
ref, _ = generate("models/default", "none", texts, 48, 1, None)
llm = LLM("models/default", quantization="int8")
calib = prompts(29)[12:]
llm.generate(calib, SamplingParams(max_tokens=16, temperature=0.0))
phase[0] = "run"
p = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
got = [llm.generate([t], p)[0].outputs[0].token_ids for t in texts]
print(ga, alpha, which, sum(prefix_share(r, g) for r, g in zip(ref, got)) / len(ref))
