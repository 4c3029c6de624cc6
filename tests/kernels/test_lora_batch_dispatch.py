"""LoRABatch on the OpenAI-Triton shrink / expand (kernels/lora.py) against its torch path, and the
choice between them (backend/lora/batch.py ``lora_kernel``), under the interpreter or on a GPU.

A mixed step: three adapters (ranks 8, 16, 64, on different targets) and base rows, interleaved
in the flattened token batch the way backend/engine/sequence.py (build_batch) builds it. Tolerance, relative to
max |reference|: 1e-5 (fp32 products, only the summation order differs); base rows bit for bit.
"""
import pytest
import torch

from backend.lora.adapter import TARGETS, LoRAAdapter
from backend.lora.batch import LoRABatch, lora_kernel

HIDDEN, Q, KV, INTER, LAYERS = 64, 64, 32, 96, 2
FAN = {"q_proj": (HIDDEN, Q), "k_proj": (HIDDEN, KV), "v_proj": (HIDDEN, KV), "o_proj": (Q, HIDDEN),
       "gate_proj": (HIDDEN, INTER), "up_proj": (HIDDEN, INTER), "down_proj": (INTER, HIDDEN)}
MODULES = {"qkv": (HIDDEN, Q + 2 * KV), "o": (Q, HIDDEN), "gate_up": (HIDDEN, 2 * INTER), "down": (INTER, HIDDEN)}


def _adapter(name: str, rank: int, targets, device) -> LoRAAdapter:
    layers = [{t: ((torch.randn(rank, FAN[t][0]) * 0.1).to(device), (torch.randn(FAN[t][1], rank) * 0.1).to(device))
               for t in targets} for _ in range(LAYERS)]
    return LoRAAdapter(name=name, path="", rank=rank, scale=16 / rank, uid=f"{name}@seeded", layers=layers)


def _spans(device):
    a8 = _adapter("a8", 8, TARGETS, device)
    a16 = _adapter("a16", 16, ("q_proj", "v_proj"), device)            # PEFT's default targets
    a64 = _adapter("a64", 64, ("k_proj", "o_proj", "up_proj", "down_proj"), device)
    # prefill chunks and decode rows of each adapter and of the base model, interleaved
    return [(None, 5), (a8, 7), (a64, 1), (a16, 11), (None, 1), (a8, 1), (a64, 9), (None, 3), (a16, 1)]


def _build(spans, device, kernel):
    return LoRABatch.build(spans, q_size=Q, kv_size=KV, intermediate=INTER, device=device, kernel=kernel)


def test_triton_batch_matches_torch_batch(triton_device):
    dev = triton_device
    spans = _spans(dev)
    torch_batch, triton_batch = _build(spans, dev, "torch"), _build(spans, dev, "triton")
    assert (torch_batch.kernel, triton_batch.kernel) == ("torch", "triton")
    base = torch.zeros(sum(n for _, n in spans), dtype=torch.bool)
    row = 0
    for adapter, n in spans:
        base[row:row + n] = adapter is None
        row += n
    for layer in range(LAYERS):
        for module, (fan_in, fan_out) in MODULES.items():
            x = torch.randn(base.numel(), fan_in).to(dev)
            out = torch.randn(base.numel(), fan_out).to(dev)
            ref, got = out.clone(), out.clone()
            torch_batch.add(ref, x, layer, module)
            triton_batch.add(got, x, layer, module)
            ref, got, out = ref.cpu(), got.cpu(), out.cpu()
            assert not torch.equal(ref[~base], out[~base]), "the adapters changed nothing: a vacuous check"
            tol = 1e-5 * float(ref.abs().max())
            err = float((got - ref).abs().max())
            assert err <= tol, (layer, module, err, tol)
            assert torch.equal(got[base], out[base]), (layer, module)   # base rows: untouched


def test_triton_batch_runs_the_triton_kernels(triton_device, monkeypatch):
    """The "triton" batch reaches kernels/lora.py (counted around the real kernels); "torch" never does."""
    import kernels.lora as kl

    calls = {"shrink": 0, "expand": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(kl, "lora_shrink", counted("shrink", kl.lora_shrink))
    monkeypatch.setattr(kl, "lora_expand", counted("expand", kl.lora_expand))
    dev = triton_device
    spans = _spans(dev)
    x, out = torch.randn(39, HIDDEN).to(dev), torch.zeros(39, Q + 2 * KV).to(dev)
    _build(spans, dev, "torch").add(out, x, 0, "qkv")
    assert calls == {"shrink": 0, "expand": 0}
    _build(spans, dev, "triton").add(out, x, 0, "qkv")
    # qkv targets: a8 q/k/v, a16 q/v, a64 k -> 6 shrink + expand pairs
    assert calls == {"shrink": 6, "expand": 6}


def test_lora_kernel_choice(triton_device):
    """Like make_attention_backend: auto = Triton on CUDA only; triton wherever the kernels run."""
    import kernels

    dev = triton_device
    assert lora_kernel("torch", dev) == "torch"
    assert lora_kernel("triton", dev) == "triton"
    assert lora_kernel("auto", "cpu") == "torch"           # the CPU's adapter rows: fused C step / torch
    assert lora_kernel("auto", "cuda") == ("triton" if kernels.triton_available("cuda") else "torch")
    if kernels.interpreted():
        with pytest.raises(ValueError, match="cannot run on cuda"):
            lora_kernel("triton", "cuda")
    with pytest.raises(ValueError, match="auto, torch or triton"):
        lora_kernel("punica", dev)
    assert _build([(None, 4)], dev, "triton") is None      # base rows only: no LoRA work at all
