"""KV storage layout, offload to host/disk tiers and swap-in, on a small real KVCacheStorage."""
from __future__ import annotations

import pytest
import torch

from backend.kv_cache import KVCacheManager, KVCacheStorage
from tests.unit.kv_helpers import cached_tokens, slots

BS, LAYERS, HEADS, DIM = 4, 2, 2, 3


def make(num_blocks: int, **kw) -> tuple[KVCacheManager, KVCacheStorage]:
    st = KVCacheStorage(num_layers=LAYERS, num_blocks=num_blocks, block_size=BS, num_kv_heads=HEADS, head_dim=DIM)
    return KVCacheManager(num_blocks=num_blocks, block_size=BS, storage=st, **kw), st


def write_kv(st: KVCacheStorage, slots: list[int], gen: torch.Generator) -> None:
    """Stand-in for the model: random K and V at these slots in every layer."""
    for layer in range(LAYERS):
        for cache in (st.k_cache(layer), st.v_cache(layer)):
            cache.view(-1, HEADS, DIM)[slots] = torch.randn(len(slots), HEADS, DIM, generator=gen).to(cache)


def read_kv(st: KVCacheStorage, slots: list[int]) -> torch.Tensor:
    return torch.stack([torch.stack([st.k_cache(l).reshape(-1, HEADS, DIM)[slots],
                                     st.v_cache(l).reshape(-1, HEADS, DIM)[slots]]) for l in range(LAYERS)])


def compute(m: KVCacheManager, st: KVCacheStorage, seq: str, tokens: list[int], gen: torch.Generator,
            salt: str | None = None) -> tuple[int, torch.Tensor]:
    """Prefill a sequence: returns (prefix-hit tokens, KV of every position)."""
    n = m.acquire_prefix(seq, tokens, salt)
    assert n is not None and m.allocate_slots(seq, len(tokens))
    write_kv(st, slots(m, seq, n, len(tokens)), gen)
    m.commit(seq, tokens, len(tokens))
    m.check_integrity()
    return n, read_kv(st, slots(m, seq, 0, len(tokens)))


def test_storage_layout_views_and_block_io():
    st = KVCacheStorage(num_layers=LAYERS, num_blocks=5, block_size=BS, num_kv_heads=HEADS, head_dim=DIM,
                        dtype=torch.float16)
    assert st.k_cache(1).shape == (5, BS, HEADS, DIM)
    assert st.k_cache(1).data_ptr() == st.kv[1, 0].data_ptr()            # views, not copies
    assert KVCacheStorage.bytes_per_block(num_layers=LAYERS, block_size=BS, num_kv_heads=HEADS,
                                          head_dim=DIM, dtype=torch.float16) == LAYERS * 2 * BS * HEADS * DIM * 2
    st.v_cache(0).view(-1, HEADS, DIM)[3 * BS + 1] = 7                   # slot = block * bs + offset
    assert st.kv[0, 1, 3, 1].eq(7).all()
    data = torch.randn(2, *st.block_shape).half()
    st.write_blocks([4, 1], data)
    assert torch.equal(st.read_blocks([4, 1]), data)
    st.copy_block(4, 0)
    assert torch.equal(st.read_blocks([0])[0], data[0])


def test_cow_copies_content():
    m, st = make(8)
    gen = torch.Generator().manual_seed(0)
    _, kv = compute(m, st, "a", list(range(6)), gen)
    m.fork("a", "b")
    assert m.allocate_slots("b", 7) and m.block_table("b") == [0, 2]
    assert torch.equal(st.read_blocks([2]), st.read_blocks([1]))
    assert torch.equal(read_kv(st, slots(m, "b", 0, 6)), kv)


def test_offload_then_swap_in_is_bit_identical_with_exact_ids():
    m, st = make(4, host_tier_blocks=8)
    gen = torch.Generator().manual_seed(1)
    a = list(range(12))
    _, kv_a = compute(m, st, "a", a + [99], gen)        # [0, 1, 2, 3]; 0-2 cached
    m.free("a")                                         # free list [3, 2, 1, 0]
    compute(m, st, "b", [50] * 16, gen)                 # takes all four: evicts 2, 1, 0
    host = m.offload.tiers[0]
    assert [e.entry_id for e in host.entries.values()] == [3, 2, 1]      # LRU order: a's tail first
    s = m.stats()
    assert (s.evictions, s.offload_out_blocks, s.offload_out_bytes) == (3, 3, 3 * st.block_bytes)
    assert cached_tokens(m, a + [0]) == 12               # the chain continues into the host tier
    assert m.block_table("b") == [3, 2, 1, 0]
    m.free("b")                                         # all four cached: tail first to the LRU tail
    assert m.pool.free.ids() == [0, 1, 2, 3]
    assert m.acquire_prefix("a2", a + [0]) == 12
    assert m.block_table("a2") == [0, 1, 2]             # fresh blocks from the head: b's tail evicted
    assert torch.equal(read_kv(st, slots(m, "a2", 0, 12)), kv_a[:, :, :12])
    # a's entries moved back (tiers are exclusive); b's three evicted blocks went out in their place.
    assert [e.entry_id for e in host.entries.values()] == [7, 6, 5]
    s = m.stats()
    assert (s.offload_in_blocks, s.offload_in_bytes, s.evictions, s.offload_out_blocks) == \
        (3, 3 * st.block_bytes, 6, 6)
    assert m.allocate_slots("a2", 13) and m.block_table("a2") == [0, 1, 2, 3]
    s = m.stats()
    assert (s.prefix_queried_tokens, s.prefix_hit_tokens) == (13 + 16 + 13, 12)
    m.check_integrity()


def test_disk_tier_receives_host_evictions_and_swaps_back(tmp_path):
    m, st = make(4, host_tier_blocks=1, disk_tier_path=str(tmp_path), disk_tier_blocks=4)
    gen = torch.Generator().manual_seed(2)
    a = list(range(12))
    _, kv_a = compute(m, st, "a", a + [99], gen)
    m.free("a")
    compute(m, st, "b", [50] * 16, gen)                 # evicts a's 3 blocks: 1 stays on host, 2 to disk
    host, disk = m.offload.tiers
    assert (len(host.entries), len(disk.entries)) == (1, 2)
    assert list(tmp_path.iterdir()) == []               # the scratch file is unlinked once mapped
    m.free("b")
    assert m.acquire_prefix("a2", a + [0]) == 12
    assert torch.equal(read_kv(st, slots(m, "a2", 0, 12)), kv_a[:, :, :12])
    m.check_integrity()


def test_last_tier_drops_lru_and_chain_stops_at_the_gap():
    m, _ = make(4, host_tier_blocks=2)
    gen = torch.Generator().manual_seed(3)
    a = list(range(12))
    compute(m, m.storage, "a", a + [99], gen)
    m.free("a")
    compute(m, m.storage, "b", [50] * 16, gen)          # evicts 2, 1, 0; host keeps the last two
    assert m.offload.tiers[0].dropped == 1
    assert cached_tokens(m, a + [0]) == 8                # blocks 0, 1 of a are still reachable
    m.check_integrity()


def test_swap_in_without_free_device_blocks_returns_none_and_changes_nothing():
    m, st = make(4, host_tier_blocks=8)
    gen = torch.Generator().manual_seed(4)
    a = list(range(12))
    compute(m, st, "a", a + [99], gen)
    m.free("a")
    compute(m, st, "b", [50] * 16, gen)                 # b holds every device block
    before = ([list(t.entries) for t in m.offload.tiers], m.pool.free.ids(), m.stats())
    assert m.acquire_prefix("a2", a + [0]) is None
    with pytest.raises(KeyError):                      # no table was made for a2
        m.block_table("a2")
    assert ([list(t.entries) for t in m.offload.tiers], m.pool.free.ids(), m.stats()) == before
    m.check_integrity()


def _return_to_first_conversation(host_tier_blocks: int) -> tuple[int, int]:
    """Two conversations that do not fit the device pool together; returns (cached prefix of
    conversation A when it left, tokens of it that must be computed again on return)."""
    m, st = make(6, host_tier_blocks=host_tier_blocks)
    gen = torch.Generator().manual_seed(5)
    a = list(range(1, 20))                              # 19 tokens: 4 full blocks + 3
    compute(m, st, "a", a, gen)
    m.free("a")
    compute(m, st, "b", list(range(100, 123)), gen)     # 23 tokens: 6 blocks, the whole pool
    m.free("b")
    follow_up = a + [7, 8, 9, 10, 11]                   # next turn: history + new message
    cached_when_left = 16
    n = m.acquire_prefix("a-turn2", follow_up)
    assert n is not None
    m.check_integrity()
    return cached_when_left, cached_when_left - min(n, cached_when_left)


def test_host_tier_avoids_recomputing_a_returning_conversation():
    assert _return_to_first_conversation(host_tier_blocks=8) == (16, 0)    # all swapped in
    assert _return_to_first_conversation(host_tier_blocks=0) == (16, 16)   # all recomputed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_storage_offloads_through_pinned_host_memory():
    st = KVCacheStorage(num_layers=LAYERS, num_blocks=4, block_size=BS, num_kv_heads=HEADS, head_dim=DIM,
                        dtype=torch.bfloat16, device="cuda")
    m = KVCacheManager(num_blocks=4, block_size=BS, storage=st, host_tier_blocks=8)
    assert m.offload.tiers[0].data.is_pinned()
    gen = torch.Generator().manual_seed(6)
    a = list(range(12))
    _, kv_a = compute(m, st, "a", a + [99], gen)
    m.free("a")
    compute(m, st, "b", [50] * 16, gen)
    m.free("b")
    assert m.acquire_prefix("a2", a + [0]) == 12
    assert torch.equal(read_kv(st, slots(m, "a2", 0, 12)), kv_a[:, :, :12])


# -- disk tier faults (issue 19) ------------------------------------------------------------------
def _disk_chain(path, blocks=4):
    import torch

    from backend.kv_cache.offload import OffloadChain
    return OffloadChain(block_shape=(2, 16, 2, 8), dtype=torch.float32, pin_memory=False, host_blocks=0,
                        disk_path=str(path), disk_blocks=blocks)


def test_disk_tier_never_touches_a_file_the_operator_named(tmp_path):
    precious = tmp_path / "precious.bin"
    precious.write_bytes(b"keep me")
    with pytest.raises(ValueError, match="existing file: give a directory"):
        _disk_chain(precious)
    assert precious.read_bytes() == b"keep me"


def test_disk_tier_in_a_directory_leaves_nothing_behind(tmp_path):
    chain = _disk_chain(tmp_path)
    assert chain.tiers[0].data.shape == (4, 2, 16, 2, 8)
    assert list(tmp_path.iterdir()) == []


def test_unusable_disk_tier_path_is_a_clear_startup_error(tmp_path):
    with pytest.raises(ValueError, match="not usable for the KV disk tier"):
        _disk_chain(tmp_path / "no" / "such" / "dir" / "kv.bin")


def test_full_disk_is_a_clear_startup_error_not_a_sigbus(tmp_path, monkeypatch):
    import errno
    import os

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", no_space)     # what a full filesystem answers
    with pytest.raises(ValueError, match="No space left on device"):
        _disk_chain(tmp_path)
    assert list(tmp_path.iterdir()) == []                     # our scratch file is gone again
