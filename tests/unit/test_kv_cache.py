"""Paged KV allocator: exact block ids, ref counts and free-list order (block_size 4 throughout)."""
from __future__ import annotations

import pytest

from backend.kv_cache import KVCacheManager, block_pool
from tests.unit.kv_helpers import cached_tokens, free_blocks, slots

BS = 4


def make(num_blocks: int = 8, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks=num_blocks, block_size=BS, **kw)


def free_ids(m: KVCacheManager) -> list[int]:
    return m.pool.free.ids()


def refs(m: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in m.pool.blocks]


def snapshot(m: KVCacheManager) -> tuple:
    """Everything observable about the allocator, to prove an operation changed nothing."""
    tables = {s: m.block_table(s) for s in sorted(m._seqs)}
    cached = sorted((h, b.block_id) for h, b in m.pool.cached.items())
    tiers = [list(t.entries) for t in m.offload.tiers]
    return tables, refs(m), free_ids(m), cached, tiers, m.stats()


def run_prompt(m: KVCacheManager, seq: str, tokens: list[int], salt: str | None = None) -> int:
    """What the scheduler does for a prompt: attach the cached prefix, compute the rest, commit."""
    n = m.acquire_prefix(seq, tokens, salt)
    assert n is not None and m.allocate_slots(seq, len(tokens))
    m.commit(seq, tokens, len(tokens))
    m.check_integrity()
    return n


def test_allocate_and_extend_across_block_boundaries():
    m = make()
    toks = list(range(100, 109))
    assert m.acquire_prefix("a", toks[:5]) == 0
    assert m.block_table("a") == [] and free_blocks(m) == 8
    assert m.allocate_slots("a", 5)
    assert m.block_table("a") == [0, 1]
    assert slots(m, "a", 0, 5) == [0, 1, 2, 3, 4]
    m.commit("a", toks[:5], 5)
    assert m.allocate_slots("a", 8)                      # still fits in block 1
    assert m.block_table("a") == [0, 1]
    m.commit("a", toks[:8], 8)
    assert m.allocate_slots("a", 9)                      # crosses into a third block
    assert m.block_table("a") == [0, 1, 2]
    assert slots(m, "a", 7, 9) == [7, 8]
    m.commit("a", toks, 9)
    assert refs(m)[:4] == [1, 1, 1, 0]
    assert free_ids(m) == [3, 4, 5, 6, 7]
    assert [b.block_hash is not None for b in m.pool.blocks[:3]] == [True, True, False]
    st = m.stats()
    assert (st.num_used_blocks, st.num_blocks, st.usage) == (3, 8, 3 / 8)
    m.check_integrity()


def test_free_releases_tail_first_cached_to_tail_uncached_to_head():
    m = make()
    run_prompt(m, "a", list(range(9)))                  # blocks 0, 1 full (cached), 2 partial
    m.free("a")
    assert free_ids(m) == [2, 3, 4, 5, 6, 7, 1, 0]      # 2 worthless -> head; 1 before 0 (tail first)
    assert refs(m) == [0] * 8
    m.free("a")                                         # unknown id: no-op
    m.check_integrity()


def test_full_and_partial_prefix_hits():
    m = make(num_blocks=10)
    prompt = list(range(10))
    assert run_prompt(m, "a", prompt) == 0             # blocks [0, 1, 2]; 0 and 1 cached
    assert cached_tokens(m, prompt) == 8
    assert run_prompt(m, "b", prompt) == 8             # full hit: shares 0, 1, new block 3
    assert m.block_table("b") == [0, 1, 3]
    assert refs(m)[:4] == [2, 2, 1, 1]
    assert run_prompt(m, "c", prompt[:4] + [99] * 6) == 4   # partial hit: first block only
    assert m.block_table("c") == [0, 4, 5]
    assert refs(m)[:2] == [3, 2]
    # Never the last token: 8 tokens hit one block (the model must compute position 7), 9 hit two.
    assert cached_tokens(m, prompt[:8]) == 4
    assert cached_tokens(m, prompt[:9]) == 8
    assert cached_tokens(m, prompt[:4]) == 0 and cached_tokens(m, []) == 0
    st = m.stats()
    assert (st.prefix_queried_tokens, st.prefix_hit_tokens) == (30, 12)   # lookups do not count
    assert m.acquire_prefix("d", prompt) == 8
    m.free("d")                                         # admission undone before allocating:
    assert m.stats() == st                              # the query is not counted
    m.check_integrity()


def test_hit_revives_free_cached_blocks_from_the_middle_of_the_lru_list():
    m = make()
    run_prompt(m, "a", list(range(9)))
    m.free("a")
    assert free_ids(m) == [2, 3, 4, 5, 6, 7, 1, 0]
    assert m.acquire_prefix("b", list(range(9))) == 8
    assert m.block_table("b") == [0, 1] and refs(m)[:2] == [1, 1]
    assert free_ids(m) == [2, 3, 4, 5, 6, 7]
    m.check_integrity()


def test_generated_tokens_are_cached_by_commit_and_not_rehashed(monkeypatch):
    calls = []
    real = block_pool.hash_block
    monkeypatch.setattr(block_pool, "hash_block", lambda *a: calls.append(a[1]) or real(*a))
    m = make()
    toks = [7, 7, 7, 7, 8, 8]
    assert m.acquire_prefix("a", toks) == 0 and m.allocate_slots("a", 6)
    calls.clear()                                       # (the lookup hashed its first miss)
    m.commit("a", toks, 6)
    assert calls == [(7, 7, 7, 7)]                      # partial block 1 is not cached yet
    for t in (9, 9, 10):                                # decode: one token per step
        n = len(toks)
        toks.append(t)
        assert m.allocate_slots("a", n + 1)
        m.commit("a", toks, n + 1)
        m.check_integrity()
    assert calls == [(7, 7, 7, 7), (8, 8, 9, 9)]        # each block hashed once, when it filled
    assert m.block_table("a") == [0, 1, 2]
    assert cached_tokens(m, toks + [0]) == 8


def test_fork_shares_blocks_and_copy_on_write_splits_the_partial_block():
    m = make()
    prompt = list(range(6))
    run_prompt(m, "a", prompt)                          # [0, 1]; block 1 holds 2 of 4 tokens
    m.fork("a", "b")
    assert m.block_table("b") == [0, 1] and refs(m)[:3] == [2, 2, 0]
    m.check_integrity()
    assert m.allocate_slots("b", 7)                     # b writes position 6 into shared block 1
    assert m.block_table("b") == [0, 2] and refs(m)[:3] == [2, 1, 1]
    assert m.stats().cow_copies == 1
    assert m.allocate_slots("a", 7)                     # a is now the only holder: no copy
    assert m.block_table("a") == [0, 1] and m.stats().cow_copies == 1
    m.commit("a", prompt + [50], 7)
    m.commit("b", prompt + [60], 7)
    m.check_integrity()
    m.free("a")
    assert refs(m)[:3] == [1, 0, 1] and free_ids(m)[0] == 1
    m.free("b")
    assert refs(m) == [0] * 8
    m.check_integrity()


def test_fork_at_a_block_boundary_needs_no_copy_and_child_chain_matches_parent():
    m = make()
    prompt = list(range(8))
    run_prompt(m, "a", prompt)                          # two full, cached blocks
    m.fork("a", "b")
    assert m.allocate_slots("b", 9) and m.block_table("b") == [0, 1, 2]
    assert m.stats().cow_copies == 0
    toks = prompt + [1, 2, 3, 4]
    m.allocate_slots("b", 12)
    m.commit("b", toks, 12)                             # the child's chain continues the parent's
    assert cached_tokens(m, toks + [0]) == 12
    m.check_integrity()


def test_eviction_takes_lru_head_so_chain_tails_go_first():
    m = make(num_blocks=4)
    a = list(range(12))
    run_prompt(m, "a", a + [99])                        # [0, 1, 2, 3]; 0-2 cached, 3 partial
    m.free("a")
    assert free_ids(m) == [3, 2, 1, 0]
    assert m.acquire_prefix("b", [50] * 8) == 0
    assert m.allocate_slots("b", 8)
    assert m.block_table("b") == [3, 2]                 # 3 was free; 2 (a's tail) is evicted
    assert m.stats().evictions == 1 and m.pool.blocks[2].block_hash is None
    assert cached_tokens(m, a + [0]) == 8
    assert m.allocate_slots("b", 12) and m.block_table("b") == [3, 2, 1]
    assert m.stats().evictions == 2 and cached_tokens(m, a + [0]) == 4
    m.check_integrity()


def test_tenant_salt_isolates_prefix_cache():
    m = make()
    prompt = list(range(9))
    run_prompt(m, "a", prompt, salt="tenant-1")
    assert cached_tokens(m, prompt, "tenant-1") == 8
    assert cached_tokens(m, prompt, "tenant-2") == 0
    assert cached_tokens(m, prompt, None) == 0
    assert run_prompt(m, "b", prompt, salt="tenant-2") == 0
    assert set(m.block_table("a")).isdisjoint(m.block_table("b"))
    assert block_pool.hash_block(b"", [1], "x") != block_pool.hash_block(b"", [1], None)


def test_forced_hash_collision_never_returns_other_content(monkeypatch):
    monkeypatch.setattr(block_pool, "hash_block", lambda *a: b"same")
    m = make(num_blocks=12)
    run_prompt(m, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # Block 1 collides with block 0's entry and is left uncached.
    assert [b.block_id for b in m.pool.cached.values()] == [0]
    assert cached_tokens(m, [9, 9, 9, 9, 5, 6, 7, 8, 0]) == 0       # other tokens
    assert cached_tokens(m, [1, 2, 3, 4, 1, 2, 3, 4, 0]) == 4       # same tokens, other position
    assert cached_tokens(m, [1, 2, 3, 4, 0], salt="t") == 0         # same tokens, other tenant
    assert run_prompt(m, "b", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4
    m.check_integrity()


def test_concurrent_identical_blocks_keep_the_first_cache_entry():
    m = make()
    prompt = list(range(6))
    for s in ("a", "b"):                                # both start before either has committed
        assert m.acquire_prefix(s, prompt) == 0 and m.allocate_slots(s, 6)
    m.commit("a", prompt, 6)
    m.commit("b", prompt, 6)
    assert m.block_table("a") == [0, 1] and m.block_table("b") == [2, 3]
    assert [b.block_id for b in m.pool.cached.values()] == [0]     # b's copy stays uncached
    toks = prompt + [6, 7]
    m.allocate_slots("b", 8)
    m.commit("b", toks, 8)                              # b's next block chains on a's entry
    assert cached_tokens(m, toks + [0]) == 8
    assert m.acquire_prefix("c", toks + [0]) == 8 and m.block_table("c") == [0, 3]
    m.free("b")
    assert free_ids(m)[0] == 2                          # the duplicate is freed as worthless
    m.check_integrity()


def test_allocation_failure_changes_nothing():
    m = make(num_blocks=4)
    run_prompt(m, "a", list(range(6)))                 # [0, 1]
    m.fork("a", "b")
    assert m.acquire_prefix("c", [9] * 8) == 0 and m.allocate_slots("c", 8)   # [2, 3]: pool full
    before = snapshot(m)
    assert not m.allocate_slots("a", 9)
    assert not m.allocate_slots("b", 7)                 # would need a block for copy-on-write
    assert snapshot(m) == before
    m.check_integrity()


def test_errors_are_clear():
    m = make()
    with pytest.raises(KeyError, match="acquire_prefix"):
        m.allocate_slots("nope", 4)
    m.acquire_prefix("a", [1, 2])
    with pytest.raises(ValueError, match="already"):
        m.acquire_prefix("a", [1, 2])
    with pytest.raises(ValueError):
        m.commit("a", [1, 2], 2)                        # no slots allocated yet


def test_prefix_caching_disabled_caches_nothing():
    m = make(enable_prefix_caching=False)
    run_prompt(m, "a", list(range(9)))
    assert m.pool.cached == {} and cached_tokens(m, list(range(9))) == 0
    m.free("a")
    assert run_prompt(m, "b", list(range(9))) == 0


def test_check_integrity_catches_corruption():
    m = make()
    run_prompt(m, "a", list(range(9)))
    m.pool.blocks[0].ref_cnt += 1                       # a ref nobody holds
    with pytest.raises(AssertionError, match="ref"):
        m.check_integrity()
    m.pool.blocks[0].ref_cnt -= 1
    m.pool.cached.pop(m.pool.blocks[1].block_hash)      # hash map loses a cached block
    with pytest.raises(AssertionError, match="hash map"):
        m.check_integrity()


def test_fork_before_commit_adopts_the_entry_the_other_holder_cached():
    m = make()
    prompt = list(range(8))
    assert m.acquire_prefix("a", prompt) == 0 and m.allocate_slots("a", 8)
    m.fork("a", "b")                                    # KV written, not yet committed
    m.commit("a", prompt, 8)
    m.commit("b", prompt, 8)                            # same shared blocks: nothing re-cached
    assert len(m.pool.cached) == 2 and refs(m)[:2] == [2, 2]
    toks = prompt + [5, 5, 5, 5]
    assert m.allocate_slots("b", 12)
    m.commit("b", toks, 12)
    assert cached_tokens(m, toks + [0]) == 12
    m.check_integrity()
