"""Block hashes for prefix caching: a chain over (parent hash, token ids, extra keys).

    block 0: h0 = H(ROOT_HASH, tokens[0:bs],   salt)
    block 1: h1 = H(h0,        tokens[bs:2bs], salt)      ...

``salt`` is the request's extra key: the tenant's (or allowed client's) cache salt, and the LoRA
adapter's identity (:func:`extra_key`), so KV computed under one adapter is never reused by
another adapter or by the base model.

A hash names a block *and its whole prefix*, so equal hashes mean "same KV" up to collisions.
Collisions are ruled out separately by comparing a :data:`CacheKey` (see ``manager.py``).

hashlib, not Python's ``hash()``: the latter is salted per process (PYTHONHASHSEED), and the disk
tier and any future cross-process cache need a stable name for the same prefix.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

ROOT_HASH = b""   # parent of the first block
ROOT_ID = 0       # cache-entry id of that (virtual) parent; real entries start at 1

# What a cached block stores to confirm a hash hit exactly:
#   (entry id of the parent block, this block's token ids, extra key e.g. tenant salt)
# Comparing the parent's *entry id* (not its hash) makes a hit exact even if every hash collides:
# entry ids are unique per cached content and never reused.
CacheKey = tuple[int, tuple[int, ...], "str | None"]


def extra_key(salt: str | None, lora_uid: str | None) -> str | None:
    """The chain's extra key for a tenant ``salt`` and an adapter (``LoRAAdapter.uid``: name and
    content digest). Length-prefixed, so no salt can spell another (salt, adapter) pair."""
    if lora_uid is None:
        return salt
    return f"lora:{len(lora_uid)}:{lora_uid}|" + ("" if salt is None else f"salt:{salt}")


def hash_block(parent_hash: bytes, token_ids: Sequence[int], salt: str | None = None) -> bytes:
    """16-byte blake2b digest of one full block, chained on ``parent_hash``."""
    h = hashlib.blake2b(digest_size=16)
    h.update(len(parent_hash).to_bytes(1, "little"))   # length prefixes keep the encoding unambiguous
    h.update(parent_hash)
    salt_bytes = b"" if salt is None else b"\x01" + salt.encode("utf-8")
    h.update(len(salt_bytes).to_bytes(4, "little"))
    h.update(salt_bytes)
    h.update(array("q", token_ids).tobytes())          # int64: any vocabulary size fits
    return h.digest()
