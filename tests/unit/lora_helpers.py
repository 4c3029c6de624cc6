"""Seeded PEFT adapters for the tiny checkpoint, written with peft itself (non-zero B)."""
from __future__ import annotations

import pathlib

import torch

# name -> (rank, alpha, target modules, seed): ranks 8, 16, 64; attention-only, MLP-only, all seven
ADAPTERS = {
    "ada8": (8, 16, ["q_proj", "v_proj"], 1),
    "ada16": (16, 8, ["gate_proj", "up_proj", "down_proj"], 2),
    "ada64": (64, 64, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 3),
}


def make_adapter(base_dir: pathlib.Path, out: pathlib.Path, rank: int, alpha: int, targets: list[str],
                 seed: int, std: float = 0.05) -> pathlib.Path:
    """Save a PEFT LoRA adapter of ``base_dir`` whose A and B come from ``seed``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                  lora_dropout=0.0, bias="none"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(peft_model.named_parameters()):
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    peft_model.save_pretrained(out)
    return out


def make_adapters(base_dir: pathlib.Path, root: pathlib.Path) -> dict[str, pathlib.Path]:
    return {name: make_adapter(base_dir, root / name, *spec) for name, spec in ADAPTERS.items()}


def peft_greedy(base_dir: pathlib.Path, adapter_dir: pathlib.Path | None, prompts: list[list[int]],
                max_new: int) -> list[list[int]]:
    """transformers' greedy tokens (exactly ``max_new``), the adapter applied by PEFT (unmerged)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                                 min_new_tokens=max_new, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out
