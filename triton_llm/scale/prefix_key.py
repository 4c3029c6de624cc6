"""The prefix chain of a request: hashes of its rendered prompt's leading full KV blocks.

Rendered exactly as the ``preprocessing`` model renders it (backend/serving/preprocess.py: the chat
template, the tokenizer), cut in the engine's ``block_size`` and hashed with the tenant salt by the
engine's own chain (backend/kv_cache/block_pool.py), so equal chains mean the engine would find the
same cached blocks. Only ``max_blocks`` leading blocks count: enough to tell conversations and
shared system prompts apart, bounded work per request.

A request on a LoRA adapter keys its chain by the adapter's name too (``extra_key``, as the engine
keys its cache by the adapter's name and digest): the same prompt on adapter A and on adapter B
(or on the base model) are different prefixes, since their KV differs.
"""
from __future__ import annotations

import pathlib

from backend.kv_cache.block_pool import ROOT_HASH, extra_key, hash_block


def chain_of(token_ids: list[int], block_size: int, salt: str | None = None,
             max_blocks: int = 64, lora: str | None = None) -> list[str]:
    """Hex hashes of the leading full blocks of ``token_ids`` (a partial last block has none),
    under tenant ``salt`` and LoRA adapter ``lora`` (its name; None: the base model)."""
    out: list[str] = []
    parent = ROOT_HASH
    salt = extra_key(salt, f"name:{lora}" if lora else None)
    full = min(len(token_ids) // block_size, max_blocks)
    for b in range(full):
        parent = hash_block(parent, token_ids[b * block_size:(b + 1) * block_size], salt)
        out.append(parent.hex())
    return out


class PrefixKeyer:
    def __init__(self, model_dir: str | pathlib.Path, block_size: int = 16, max_blocks: int = 64) -> None:
        from backend.serving.preprocess import Preprocessor

        self.pre = Preprocessor(model_dir, context_window=1 << 30)   # rendering only: no length check
        self.block_size = block_size
        self.max_blocks = max_blocks

    def chain(self, *, prompt: str | None = None, messages: list[dict] | None = None,
              tenant: str | None = None, tools: list[dict] | None = None, lora: str | None = None) -> list[str]:
        """The request's chain; [] when it cannot be rendered (preprocessing will say why)."""
        try:
            ids = (self.pre.encode_messages(messages, tools) if messages is not None
                   else self.pre.encode_prompt(prompt or ""))
        except Exception:                    # noqa: BLE001 -- a bad request is refused downstream
            return []
        return chain_of(ids, self.block_size, tenant or None, self.max_blocks, lora or None)
