"""Randomized scheduler-like workload on a small pool: integrity after every operation, and every
cached or copied block holds exactly the KV its own sequence would have computed."""
from __future__ import annotations

import random

import pytest
import torch

from backend.kv_cache import KVCacheManager, KVCacheStorage, block_pool
from tests.unit.kv_helpers import free_blocks, slots

BS, NUM_BLOCKS, MAX_LEN = 4, 24, 40
PRIME = 8388593   # values stay below 2**23: exact in float32


def kv_value(prev: int, token: int) -> int:
    """Stand-in for a position's KV: depends on the whole prefix (and the salt via the seed)."""
    return (prev * 1000003 + token + 1) % PRIME


class Workload:
    def __init__(self, m: KVCacheManager, rng: random.Random):
        self.m, self.rng = m, rng
        self.flat_k = m.storage.k_cache(0).reshape(-1)   # one layer, one head, head_dim 1
        self.running: dict[str, dict] = {}
        self.waiting: list[dict] = []                   # preempted: recomputed (or hit) later
        self.bases = [[rng.randrange(4) for _ in range(10)] for _ in range(3)]
        self.next_id = 0

    def values(self, s: dict, upto: int) -> list[int]:
        vals, v = [], 1 + ["t1", None].index(s["salt"])
        for t in s["tokens"][:upto]:
            v = kv_value(v, t)
            vals.append(v)
        return vals

    def check_content(self, sid: str) -> None:
        s = self.running[sid]
        got = self.flat_k[slots(self.m, sid, 0, s["computed"])].long().tolist()
        assert got == self.values(s, s["computed"]), f"{sid}: KV content differs from its own prefix"

    def start(self) -> None:
        if self.waiting and self.rng.random() < 0.5:
            s = self.waiting.pop(0)
        else:
            tokens = self.rng.choice(self.bases)[: self.rng.randrange(11)] + \
                [self.rng.randrange(4) for _ in range(self.rng.randrange(1, 11))]
            s = {"tokens": tokens, "salt": self.rng.choice(["t1", None])}
        sid = f"s{self.next_id}"
        self.next_id += 1
        n = self.m.acquire_prefix(sid, s["tokens"], s["salt"])
        if n is None:
            self.waiting.append(s)
            return
        assert n % BS == 0 and n < len(s["tokens"])
        self.running[sid] = dict(s, computed=n)
        self.check_content(sid)

    def step(self, sid: str) -> None:
        s = self.running[sid]
        if s["computed"] < len(s["tokens"]):                 # (chunked) prefill
            num_new = min(len(s["tokens"]) - s["computed"], self.rng.randrange(1, 9))
        else:                                                # decode one sampled token
            s["tokens"].append(self.rng.randrange(4))
            num_new = 1
        if not self.m.allocate_slots(sid, s["computed"] + num_new):
            self.m.free(sid)                                 # preempt: recompute later
            self.waiting.append({"tokens": s["tokens"], "salt": s["salt"]})
            del self.running[sid]
            return
        start, end = s["computed"], s["computed"] + num_new
        vals = self.values(s, end)[start:]
        self.flat_k[slots(self.m, sid, start, end)] = torch.tensor(vals, dtype=torch.float32)
        s["computed"] = end
        self.m.commit(sid, s["tokens"], end)
        self.check_content(sid)
        if len(s["tokens"]) >= MAX_LEN:
            self.finish(sid)

    def fork(self, sid: str) -> None:
        child = f"s{self.next_id}"
        self.next_id += 1
        self.m.fork(sid, child)
        s = self.running[sid]
        self.running[child] = dict(s, tokens=list(s["tokens"]))

    def finish(self, sid: str) -> None:
        self.m.free(sid)
        del self.running[sid]

    def run(self, num_ops: int) -> None:
        for _ in range(num_ops):
            r = self.rng.random()
            if not self.running or (r < 0.15 and len(self.running) < 8):
                self.start()
            elif r < 0.80:
                self.step(self.rng.choice(list(self.running)))
            elif r < 0.88:
                self.fork(self.rng.choice(list(self.running)))
            else:
                self.finish(self.rng.choice(list(self.running)))   # finish or abort
            self.m.check_integrity()
        for sid in list(self.running):
            self.finish(sid)
        self.m.check_integrity()


@pytest.mark.parametrize("tiers", ["none", "host", "host+disk"])
def test_random_operations_keep_integrity_and_content(tiers, tmp_path):
    storage = KVCacheStorage(num_layers=1, num_blocks=NUM_BLOCKS, block_size=BS, num_kv_heads=1, head_dim=1)
    kw = {"none": {}, "host": {"host_tier_blocks": 12},
          "host+disk": {"host_tier_blocks": 4, "disk_tier_blocks": 8, "disk_tier_path": str(tmp_path)}}[tiers]
    m = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BS, storage=storage, **kw)
    w = Workload(m, random.Random(1234))
    w.run(5000)
    assert free_blocks(m) == NUM_BLOCKS and m.stats().num_used_blocks == 0
    st = m.stats()
    # The workload really exercised sharing, copy-on-write, eviction and (with tiers) swap-in.
    assert st.prefix_hit_tokens > 0 and st.cow_copies > 0 and st.evictions > 0
    assert (st.offload_in_blocks > 0) == (tiers != "none")


def test_random_operations_stay_exact_when_every_hash_collides(monkeypatch):
    """A hash that ignores parent and salt makes unrelated blocks collide all the time; the key
    check must still hand out only a sequence's own prefix (check_content would fail otherwise)."""
    real = block_pool.hash_block
    monkeypatch.setattr(block_pool, "hash_block", lambda parent, toks, salt: real(b"", toks, None))
    storage = KVCacheStorage(num_layers=1, num_blocks=NUM_BLOCKS, block_size=BS, num_kv_heads=1, head_dim=1)
    m = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BS, storage=storage, host_tier_blocks=12)
    Workload(m, random.Random(99)).run(3000)
    assert free_blocks(m) == NUM_BLOCKS and m.stats().prefix_hit_tokens > 0
