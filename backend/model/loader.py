"""Load a Hugging Face safetensors checkpoint into :class:`LlamaForCausalLM`.

Reads ``model.safetensors`` or the shards named by ``model.safetensors.index.json``, one tensor at
a time, converting each to the target dtype as it is copied into place, so peak memory is the model
plus one tensor. HF names map onto ours with q/k/v and gate/up fused::

    model.layers.N.self_attn.{q,k,v}_proj.{weight,bias} -> ...self_attn.qkv_proj  rows [q | k | v]
    model.layers.N.mlp.{gate,up}_proj.{weight,bias}     -> ...mlp.gate_up_proj    rows [gate | up]
    lm_head.weight                                      -> lm_head (skipped when tied)

Weight placement (issue 15, fp32 decode bandwidth): on CPU every parameter is a view into one
anonymous mapping aligned to 2 MiB and advised ``MADV_HUGEPAGE`` (:func:`weight_arena`), so a
decode step that streams all weights once per token walks 2 MiB pages instead of 4 KiB ones (with
``/sys/kernel/mm/transparent_hugepage/enabled`` at ``madvise`` or ``always``; SmolLM2's fused
step ~1.1x at one stream, docs/kernels.md). Not for a float checkpoint quantized at load (its
float projections are dropped after loading; an arena would keep their memory).
``TRITON_LLM_HUGE_PAGES=0`` keeps torch's own allocations.
"""
from __future__ import annotations

import json
import mmap
import pathlib
import re

import torch
from torch import nn

from backend.model.config import ModelConfig
from backend.model.llama import LlamaForCausalLM, RotaryEmbedding
from common import env

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FUSED = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias|qweight|scales|zeros)$")
# CPU flags that make bf16 matmuls pay (oneDNN's AMX tiles or AVX-512 bf16 dot products). On
# AVX2-only CPUs bf16 GEMMs convert to fp32 internally and run slower than fp32 ones.
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def auto_dtype(device: str | torch.device = "cpu", flags: set[str] | None = None) -> str:
    """``dtype=auto``: bfloat16 on CUDA and on CPUs with AMX-BF16 or AVX512-BF16, else float32."""
    if torch.device(device).type == "cuda":
        return "bfloat16"
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if any(f in flags for f in BF16_CPU_FLAGS) else "float32"


def parse_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    if name == "auto":
        name = auto_dtype(device)
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)} (got {name!r})")
    return DTYPES[name]


KV_CACHE_DTYPES = {"fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16,
                   "bfloat16": torch.bfloat16}


def kv_cache_torch_dtype(args) -> torch.dtype:
    """The KV pool's element type for ``args`` (backend.config.EngineConfig): ``kv_cache_dtype`` ``auto`` = the
    model's dtype, ``fp16`` / ``bf16`` (also spelled ``float16`` / ``bfloat16``) a half-size cache
    whatever the model's dtype (attention math stays fp32 on the CPU paths). The name was checked
    by ``EngineConfig``."""
    name = args.kv_cache_dtype
    return parse_dtype(args.dtype, args.device) if name == "auto" else KV_CACHE_DTYPES[name]


def checkpoint_files(model_dir: str | pathlib.Path) -> list[pathlib.Path]:
    model_dir = pathlib.Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise ValueError(f"{model_dir}: no model.safetensors or model.safetensors.index.json "
                     "(only safetensors checkpoints are supported)")


def iter_checkpoint(model_dir: str | pathlib.Path):
    """Yield (hf_name, tensor) for every tensor in the checkpoint, in file order."""
    from safetensors import safe_open

    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _fused_slice(cfg: ModelConfig, proj: str) -> tuple[str, int, int]:
    """(fused parameter name, first row, row count) for one HF projection."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter, inter)}[proj]


HUGE_PAGE = 2 << 20
_ALIGN = 64        # each parameter's first byte: a cache line (the C kernels' vector loads)


def huge_pages_enabled() -> bool:
    return env.flag("TRITON_LLM_HUGE_PAGES")


def weight_arena(nbytes: int) -> torch.Tensor:
    """An uninitialized uint8 CPU tensor of ``nbytes`` whose first byte is 2 MiB-aligned, inside an
    anonymous mapping advised ``MADV_HUGEPAGE`` (where the kernel has it): transparent huge pages
    for weights read once per decoded token. The tensor keeps the mapping alive."""
    size = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE
    buf = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(buf, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE, start, size)
        except OSError:            # a kernel without THP: ordinary pages, same layout
            pass
    return whole[start:start + nbytes]


def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device, arena: bool = False) -> None:
    """Replace every meta parameter with uninitialized storage of the target dtype/device; with
    ``arena`` (CPU only), as views into one :func:`weight_arena`, each 64-byte aligned."""
    from backend.quant.apply import module_dtypes     # quantized tensors keep their own dtypes

    slots = []          # (module, name, shape, dtype)
    for module in model.modules():
        dtypes = module_dtypes(module, dtype)
        for name, p in list(module._parameters.items()):
            if p is not None:
                slots.append((module, name, p.shape, dtypes[name]))
    if not (arena and device.type == "cpu" and huge_pages_enabled()):
        for module, name, shape, dt in slots:
            module._parameters[name] = nn.Parameter(torch.empty(shape, dtype=dt, device=device), requires_grad=False)
        return
    offsets, total = [], 0
    for _, _, shape, dt in slots:
        offsets.append(total)
        total += -(-shape.numel() * dt.itemsize // _ALIGN) * _ALIGN
    buf = weight_arena(total)
    for (module, name, shape, dt), off in zip(slots, offsets):
        t = buf[off:off + shape.numel() * dt.itemsize].view(dt).view(shape)
        module._parameters[name] = nn.Parameter(t, requires_grad=False)


def load_model(model_dir: str | pathlib.Path, cfg: ModelConfig, *, dtype: torch.dtype,
               device: str | torch.device = "cpu", max_positions: int | None = None,
               quantization: str = "none", quant_group_size: int = 32,
               quant_lm_head: bool = False) -> LlamaForCausalLM:
    """Build the model and fill every parameter from the checkpoint; ValueError on any mismatch.

    ``quantization`` int8/int4 quantizes the decoder projections after loading (backend/quant); a
    checkpoint with a ``quantization_config`` is loaded quantized as it is stored."""
    from backend.quant.apply import checkpoint_quant_config, finish_load, prepare_quantized

    device = torch.device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, rotary=None)
        qc = checkpoint_quant_config(model_dir)
        if qc:
            prepare_quantized(model, qc)
    _materialize(model, dtype, device, arena=qc is not None or quantization == "none")
    model.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope, device)
    params = dict(model.named_parameters())
    # Rows still to be filled, per parameter: a fused one is complete when all its parts arrived.
    missing = {name: p.shape[0] if p.dim() else 1 for name, p in params.items()}

    for hf_name, tensor in iter_checkpoint(model_dir):
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue                                     # old checkpoints store it; we recompute
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue                                     # some tied checkpoints store both copies
        name, row0, rows = hf_name, 0, None
        m = _FUSED.match(hf_name)
        if m:
            fused, row0, rows = _fused_slice(cfg, m.group(2))
            name = f"{m.group(1)}.{fused}.{m.group(3)}"
        if name == "model.embed_tokens.weight":
            name = "model.embed_tokens"
        elif name == "lm_head.weight":
            name = "lm_head"
        if name not in params:
            raise ValueError(f"{model_dir}: unexpected tensor {hf_name!r} for {cfg.model_type} config")
        target = params[name] if rows is None else params[name].narrow(0, row0, rows)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{model_dir}: {hf_name} has shape {tuple(tensor.shape)}, "
                             f"config implies {tuple(target.shape)}")
        target.copy_(tensor)
        missing[name] -= target.shape[0] if target.dim() else 1

    absent = [n for n, left in missing.items() if left]
    if absent:
        raise ValueError(f"{model_dir}: checkpoint lacks {', '.join(absent[:5])}"
                         f"{' ...' if len(absent) > 5 else ''}")
    finish_load(model, model_dir, quantization, quant_group_size, lm_head=quant_lm_head)
    return model.eval()
