"""Llama-family decoder (Llama, Mistral, Qwen2) over a flattened, unpadded batch.

Every linear layer runs once on all of the step's tokens ``[num_tokens, hidden]``, whatever
sequence they belong to; only attention looks at sequence boundaries, through the paged KV cache
(:mod:`backend.model.attention`). q/k/v and gate/up are fused into one matmul each; the loader
fills their row slices from the Hugging Face ``q_proj``/``k_proj``/``v_proj`` and
``gate_proj``/``up_proj`` tensors::

    qkv_proj.weight rows:  [ q: Hq*D | k: Hkv*D | v: Hkv*D ]
    gate_up_proj rows:     [ gate: I | up: I ]

Numerics follow transformers' modeling_llama: RMSNorm in fp32 then cast back, RoPE cos/sin computed
in fp32 then cast to the activation dtype, rotate-half (GPT-NeoX) layout.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from backend.model.attention import AttentionBackend, AttentionMetadata
from backend.model.config import ModelConfig, RopeConfig

if TYPE_CHECKING:
    from backend.lora.batch import LoRABatch


def _param(*shape: int) -> nn.Parameter:
    # The loader builds the model on the meta device and then allocates every parameter in the
    # target dtype/device, so no fp32 copy and no random init ever exists.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused op, bit-identical to the composite below in fp32 (pinned by the parity tests);
            # in bf16/fp16 it differs from transformers' cast-then-scale order, so those keep it.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] fp32, with linear or llama3 (Llama 3.1) scaling."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding:
    """cos/sin for every position up to ``max_positions``, looked up by each token's position.

    A plain object, not a module: it stays fp32 whatever dtype the weights are loaded in."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig, device="cpu"):
        inv_freq = rope_inv_freq(head_dim, rope)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.cos = freqs.cos().to(device)   # [max_positions, D/2] fp32
        self.sin = freqs.sin().to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, 1, D/2] each, broadcast over heads."""
        cos = self.cos.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> rotated copy; halves (x1, x2) rotate as (x1 c - x2 s, x2 c + x1 s)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.index = index                # the layer's, to find its LoRA weights
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.o_bias)

    def forward(self, x, cos, sin, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend: AttentionBackend, lora: LoRABatch | None = None) -> torch.Tensor:
        t, hq = x.shape[0], self.num_heads
        qkv = self.qkv_proj.forward(x)
        if lora is not None:              # adapters' rows only (backend/lora/batch.py)
            lora.add(qkv, x, self.index, "qkv")
        # q and k sit side by side in the fused output: rotate them as one [T, Hq + Hkv, D] tensor
        # (half the elementwise op calls; the same arithmetic per element).
        qk = apply_rope(qkv[:, :self.q_size + self.kv_size].view(t, hq + self.num_kv_heads, self.head_dim),
                        cos, sin)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        o = backend.forward(qk[:, :hq], qk[:, hq:], v, kv_cache[0], kv_cache[1], meta, self.scale)
        o = o.reshape(t, self.q_size)
        out = self.o_proj.forward(o)
        if lora is not None:
            lora.add(out, o, self.index, "o")
        return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.index = index
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        if lora is None:
            gate, up = self.gate_up_proj.forward(x).split(self.intermediate, dim=-1)
            return self.down_proj.forward(F.silu(gate) * up)
        gate_up = self.gate_up_proj.forward(x)
        lora.add(gate_up, x, self.index, "gate_up")
        gate, up = gate_up.split(self.intermediate, dim=-1)
        act = F.silu(gate) * up
        out = self.down_proj.forward(act)
        lora.add(out, act, self.index, "down")
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, index)

    def forward(self, h, cos, sin, kv_cache, meta, backend, lora: LoRABatch | None = None) -> torch.Tensor:
        # .forward, not __call__: no hooks are used, and nn.Module.__call__ costs a few microseconds
        # per call, ~10 calls per layer per step -- felt on small models where a step is ~1 ms/layer.
        h = h + self.self_attn.forward(self.input_layernorm.forward(h), cos, sin, kv_cache, meta, backend, lora)
        return h + self.mlp.forward(self.post_attention_layernorm.forward(h), lora)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names mirror transformers' (``model.layers.N.self_attn...``) except the fused
    ``qkv_proj`` / ``gate_up_proj``; a tied ``lm_head`` is the embedding tensor itself."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)
        self.lm_head_q = None       # a QuantLinear copy of the head (engine option quant_lm_head)
        self.rotary = rotary

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: AttentionBackend,
                logits_indices: torch.Tensor | None = None, lora: LoRABatch | None = None) -> torch.Tensor:
        """input_ids/positions [num_tokens] -> fp32 logits [len(logits_indices) or num_tokens, vocab].

        Writes this step's K/V into ``kv_caches[layer] = (k_cache, v_cache)`` at ``meta.slot_mapping``.
        ``lora`` adds each adapter's low-rank products to its own rows' projections.
        """
        h = self.trunk(input_ids, positions, meta, kv_caches, backend, lora)
        if logits_indices is not None:
            # Norm and lm_head are per row: run them on the wanted rows only.
            h = h.index_select(0, logits_indices)
        return self.head(h)

    def trunk(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: AttentionBackend,
              lora: LoRABatch | None = None) -> torch.Tensor:
        """Every token's hidden state before the final norm [num_tokens, hidden] (K/V written)."""
        h = F.embedding(input_ids, self.model.embed_tokens)
        cos, sin = self.rotary.lookup(positions, h.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h = layer.forward(h, cos, sin, kv_cache, meta, backend, lora)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head on the given rows -> fp32 logits."""
        h = self.model.norm.forward(h)
        if self.lm_head_q is not None:          # quant_lm_head (backend/quant/apply.py)
            return self.lm_head_q(h).float()
        # The matmul stays in the model dtype (as in transformers); the result is upcast to fp32.
        return F.linear(h, self.lm_head_weight()).float()
