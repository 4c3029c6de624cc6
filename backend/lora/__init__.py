"""Multi-LoRA serving (docs/lora.md): PEFT adapters loaded and validated against the base model
(``adapter.py``), a bounded registry of resident adapters (``registry.py``) and the per-step
grouping that adds each adapter's low-rank products to its own tokens' projections (``batch.py``)."""
from backend.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from backend.lora.batch import LoRABatch
from backend.lora.registry import LoRARegistry

__all__ = ["LoRAAdapter", "LoRABatch", "LoRAError", "LoRARegistry", "load_adapter"]
