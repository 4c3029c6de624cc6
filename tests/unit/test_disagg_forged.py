"""Forged hand-over records and foreign shared-memory segments, refused: every field of a record
is checked before an engine thread sees it, the record carries no salt (the caller's is used), and
the decode side attaches only to its own user's private segment of the requesting owner."""
from __future__ import annotations

import json
import os

import pytest
import torch

from backend.disagg.connector import TransferError
from backend.disagg.handover import GENERATOR_STATE_BYTES, Handover, generator_state
from backend.disagg.shm import SHM_DIR, SharedMemoryConnector

SHAPE = (3, 2, 2, 16, 4, 8)
VOCAB, MAX_LEN = 100, 256


def _record(**over) -> dict:
    rec = Handover(request_id="r", prompt_token_ids=list(range(5, 45)), first_token=9,
                   params={"temperature": 0.0, "max_tokens": 8}, max_tokens=8, num_kv_tokens=40,
                   block_size=16, block_shape=list(SHAPE[1:]), dtype="float32",
                   locator={"kind": "shm", "name": "llmkv_" + "ab" * 16, "shape": list(SHAPE), "dtype": "float32"},
                   first_logprob=[9, -0.5, [[9, -0.5], [3, -1.2]]],
                   generator_state=generator_state(torch.Generator().manual_seed(3)))
    return {**json.loads(rec.to_json()), **over}


def _validate(d: dict) -> Handover:
    rec = Handover.from_json(json.dumps(d))
    rec.validate(vocab_size=VOCAB, max_model_len=MAX_LEN)
    return rec


def test_a_sound_record_passes_and_round_trips():
    rec = _validate(_record())
    assert rec.generator().get_state().numel() == GENERATOR_STATE_BYTES
    assert rec.logprob().top == [(9, -0.5), (3, -1.2)]


FORGED = {
    "queue_time": [{"queue_time": "soon"}, {"queue_time": -1.0}, {"queue_time": float("nan")}],
    "generator_state": [{"generator_state": "!!not base64!!"}, {"generator_state": "AAAA"}, {"generator_state": 7}],
    "first_token": [{"first_token": VOCAB}, {"first_token": -1}, {"first_token": "9"}, {"first_token": True}],
    "prompt_token_ids": [{"prompt_token_ids": [5, VOCAB]}, {"prompt_token_ids": []},
                         {"prompt_token_ids": [1.5] * 40}, {"prompt_token_ids": list(range(MAX_LEN + 1))}],
    "num_kv_tokens": [{"num_kv_tokens": 41}, {"num_kv_tokens": 10 ** 9}],
    "max_tokens": [{"max_tokens": 0}, {"max_tokens": 10 ** 9}],
    "block counts": [{"locator": {"kind": "shm", "name": "llmkv_" + "ab" * 16, "shape": [10 ** 6, *SHAPE[1:]],
                                  "dtype": "float32"}},
                     {"block_shape": [2, 2, 16, 4]}, {"block_size": 0}, {"num_cached_tokens": 41}],
    "params": [{"params": {"n": 2}}, {"params": {"temperature": -1}}, {"params": {"evil": 1}},
               {"params": {"structured": {"type": "regex", "value": "a"}}}, {"params": []}],
    "other": [{"stream": "yes"}, {"deadline_in": float("inf")}, {"first_logprob": [9, 0.5, []]},
              {"first_logprob": [9, -0.5, [[1]]]}, {"extra": {"staged_at": "now"}}, {"version": 1}],
}


@pytest.mark.parametrize("field", sorted(FORGED))
def test_a_forged_record_is_a_value_error_naming_what_is_wrong(field):
    for over in FORGED[field]:
        with pytest.raises((ValueError, TypeError)):
            _validate(_record(**over))


def test_unknown_fields_and_shapes_are_refused_at_parse():
    for text in [json.dumps({**_record(), "salt": "tenant:victim"}),     # the salt is the caller's
                 json.dumps({**_record(), "priority": -10}),
                 "[1, 2]", "[" * 100_000 + "]" * 100_000, "x" * (9 << 20)]:
        with pytest.raises(ValueError):
            Handover.from_json(text)


def _segment(conn, owner="tenant:a") -> tuple[dict, str]:
    loc = conn.stage(torch.ones(SHAPE), owner=owner)
    return loc, os.path.join(SHM_DIR, loc["name"])


@pytest.fixture
def shm_conn():
    if not os.path.isdir(SHM_DIR):
        pytest.skip("no /dev/shm")
    conn = SharedMemoryConnector()
    yield conn
    conn.close()


def test_shm_segments_are_private_and_a_loose_mode_is_refused(shm_conn):
    loc, path = _segment(shm_conn)
    assert os.stat(path).st_mode & 0o777 == 0o600 and len(loc["name"]) == len("llmkv_") + 32
    os.chmod(path, 0o644)
    fetcher = SharedMemoryConnector()
    with pytest.raises(TransferError, match="private segment"):
        fetcher.fetch(loc, 0, 3, owner="tenant:a")
    assert os.path.exists(path)                                        # refused, left in place
    os.chmod(path, 0o600)
    assert torch.equal(fetcher.fetch(loc, 0, 3, owner="tenant:a"), torch.ones(SHAPE))
    assert not os.path.exists(path)


@pytest.mark.skipif(os.getuid() != 0, reason="chown needs root")
def test_shm_refuses_a_segment_of_another_user(shm_conn):
    loc, path = _segment(shm_conn)
    os.chown(path, 65534, -1)
    with pytest.raises(TransferError, match="uid 65534"):
        SharedMemoryConnector().fetch(loc, 0, 3, owner="tenant:a")
    os.chown(path, 0, -1)
    assert os.path.exists(path)


def test_shm_refuses_a_planted_symlink_or_headerless_segment(shm_conn, tmp_path):
    name = "llmkv_" + "cd" * 16
    loc = {"kind": "shm", "name": name, "shape": list(SHAPE), "dtype": "float32"}
    target = tmp_path / "victim"
    target.write_bytes(b"\0" * (64 + torch.Size(SHAPE).numel() * 4))
    os.symlink(target, os.path.join(SHM_DIR, name))
    try:
        with pytest.raises(TransferError):
            SharedMemoryConnector().fetch(loc, 0, 3)
    finally:
        os.unlink(os.path.join(SHM_DIR, name))
    fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_WRONLY, 0o600)   # right name, no header
    os.write(fd, b"\0" * (64 + torch.Size(SHAPE).numel() * 4))
    os.close(fd)
    try:
        with pytest.raises(TransferError, match="not this owner"):
            SharedMemoryConnector().fetch(loc, 0, 3)
        assert os.path.exists(os.path.join(SHM_DIR, name)) and target.exists()
    finally:
        os.unlink(os.path.join(SHM_DIR, name))


def test_shm_a_second_tenant_cannot_fetch_or_release_the_first_tenants_transfer(shm_conn):
    loc, path = _segment(shm_conn, owner="tenant:a")
    other = SharedMemoryConnector()
    with pytest.raises(TransferError, match="not this owner"):
        other.fetch(loc, 0, 3, owner="tenant:b")
    other.release(loc, owner="tenant:b")
    with pytest.raises(TransferError, match="not this owner"):
        other.fetch(loc, 0, 3)                                          # no tenant: another owner
    assert os.path.exists(path) and other.stats().fetched == 0
    assert torch.equal(other.fetch(loc, 0, 3, owner="tenant:a"), torch.ones(SHAPE))
