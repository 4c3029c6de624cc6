"""KV connectors on their own: the same test for shared memory and TCP, with the staging side
in another process; bounds, consumption, release, tokens, and the hand-over record's checks."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from backend.disagg.connector import TransferError
from backend.disagg.handover import Handover
from backend.disagg.shm import SharedMemoryConnector
from backend.disagg.tcp import TcpConnector

SHAPE = (5, 2, 2, 4, 2, 3)      # [blocks, layers, k/v, block_size, heads, dim]

STAGER = r"""
import json, sys, torch
from backend.disagg.shm import SharedMemoryConnector
from backend.disagg.tcp import TcpConnector
kind = sys.argv[1]
conn = SharedMemoryConnector() if kind == "shm" else TcpConnector(secret="s3cret-for-tests")
blocks = torch.arange(%d, dtype=torch.float32).reshape(%r)
print(json.dumps([conn.stage(blocks), conn.stage(blocks)]), flush=True)
sys.stdin.readline()            # stay alive (and serving) until the test is done
conn.close()
""" % (torch.Size(SHAPE).numel(), SHAPE)


def make(kind: str):
    return SharedMemoryConnector() if kind == "shm" else TcpConnector(secret="s3cret-for-tests", timeout=5.0)


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_fetch_from_another_process(kind):
    proc = subprocess.Popen([sys.executable, "-c", STAGER, kind], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    try:
        loc_a, loc_b = json.loads(proc.stdout.readline())
        conn = make(kind)
        full = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).reshape(SHAPE)
        got = conn.fetch(loc_a, 2, 3)                      # the first two blocks are "prefix hits"
        assert torch.equal(got, full[2:5])
        with pytest.raises(TransferError):
            conn.fetch(loc_a, 0, 1)                        # a transfer is read once
        with pytest.raises(TransferError):
            conn.fetch(loc_b, 4, 2)                        # out of range: refused, nothing read
        conn.release(loc_b, owner="")                      # the decode side then releases it
        with pytest.raises(TransferError):
            conn.fetch(loc_b, 0, 1)
        st = conn.stats()
        assert st.fetched == 1 and st.fetched_bytes == full[2:5].numel() * 4 and st.skipped_blocks == 2
    finally:
        proc.stdin.write("\n")
        proc.stdin.close()
        proc.wait(timeout=20)
    assert proc.returncode == 0


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_release_drops_staged_and_is_idempotent(kind):
    conn = make(kind)
    try:
        loc = conn.stage(torch.ones(SHAPE))
        conn.release(loc)
        conn.release(loc)
        with pytest.raises(TransferError):
            conn.fetch(loc, 0, 1)
        assert conn.stats().released == 1
    finally:
        conn.close()


def test_tcp_staging_is_bounded():
    server = TcpConnector(max_staged_bytes=torch.Size(SHAPE).numel() * 4)
    try:
        server.stage(torch.ones(SHAPE))
        with pytest.raises(TransferError, match="max_staged_bytes"):
            server.stage(torch.ones(SHAPE))
    finally:
        server.close()


def test_handover_record_round_trip_and_checks():
    rec = Handover(request_id="r", prompt_token_ids=[5, 6, 7], first_token=9, params={"temperature": 0.0},
                   max_tokens=4, num_kv_tokens=3, block_size=16, block_shape=[2, 2, 16, 4, 8],
                   dtype="float32", locator=None, first_logprob=[9, -0.5, [[9, -0.5], [3, -1.2]]])
    back = Handover.from_json(rec.to_json())
    assert back == rec and back.sampling_params().temperature == 0.0
    assert back.logprob().top == [(9, -0.5), (3, -1.2)]
    ok = dict(vocab_size=100, block_size=16, block_shape=(2, 2, 16, 4, 8), dtype=torch.float32)
    assert back.check(**ok) is None
    assert "dtype" in back.check(**{**ok, "dtype": torch.bfloat16})
    assert "block shape" in back.check(**{**ok, "block_shape": (2, 2, 16, 4, 4)})
    assert "vocabulary" in back.check(**{**ok, "vocab_size": 5})
    with pytest.raises(ValueError, match="unknown fields"):
        Handover.from_json(json.dumps({**json.loads(rec.to_json()), "evil": 1}))


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_staged_transfers_expire_after_the_ttl(kind):
    conn = make(kind)
    try:
        old = conn.stage(torch.ones(SHAPE))
        assert conn.expire(ttl=60.0) == 0 and conn.num_staged() == 1      # young: kept
        conn.start_reaper(ttl=0.2, interval=0.05)
        deadline = time.monotonic() + 5
        while conn.num_staged() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert conn.num_staged() == 0 and conn.stats().expired == 1
        with pytest.raises(TransferError):
            conn.fetch(old, 0, 1)                   # gone: the decode side recomputes
        conn.stop_reaper()
        fresh = conn.stage(torch.full(SHAPE, 2.0))
        assert conn.expire(ttl=60.0) == 0                                   # only the old ones go
        assert torch.equal(make(kind).fetch(fresh, 0, 5), torch.full(SHAPE, 2.0))
    finally:
        conn.close()


def test_shm_refuses_foreign_segment_names():
    """A record's locator can only name our own transfer segments (never Triton's, never a path)."""
    conn = SharedMemoryConnector()
    for name in ("tllm1234_8001_region", "llmkv_../../etc", "llmkv_a/b", 7):
        loc = {"kind": "shm", "name": name, "shape": list(SHAPE), "dtype": "float32"}
        with pytest.raises(TransferError, match="not a KV transfer segment"):
            conn.fetch(loc, 0, 1)
        conn.release(loc)                           # ignored, no exception


@pytest.mark.parametrize("dev_shm", [True, False])
def test_shm_fetch_of_an_unaligned_range_maps_or_copies_the_same_bytes(dev_shm, monkeypatch):
    """The decode side's mapping starts on a page, the range inside it need not (blocks of 1,250
    floats = 5,000 bytes); without /dev/shm the portable path gives the same tensor."""
    import backend.disagg.shm as shm_mod
    if not dev_shm:
        monkeypatch.setattr(shm_mod, "SHM_DIR", "/nonexistent-shm-dir")
    elif not __import__("os").path.isdir(shm_mod.SHM_DIR):
        pytest.skip("no /dev/shm")
    full = torch.arange(8 * 1250, dtype=torch.float32).reshape(8, 1, 2, 625, 1, 1)
    stager, fetcher = SharedMemoryConnector(), SharedMemoryConnector()
    loc = stager.stage(full)
    got = fetcher.fetch(loc, 3, 4)
    assert torch.equal(got, full[3:7])
    fetcher.discard(got)
    del got
    with pytest.raises(TransferError):
        fetcher.fetch(loc, 0, 1)                           # read once: the name is gone
    assert fetcher.stats().fetched == 1 and stager.num_staged() == 0
    deadline = time.monotonic() + 5
    while fetcher._graveyard and time.monotonic() < deadline:   # unmapped by the releaser thread
        time.sleep(0.01)
    assert not fetcher._graveyard
