"""PrefixAwareRouter's load accounting without a Ray cluster: the router object on its own, fed
the calls Ray Serve makes (choose_replicas, on_request_routed, on_request_completed).

A burst is chosen before any of it is routed; the router counts its own choices as load, so a
burst that shares a prefix still respects the load bound instead of all landing on one replica.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve.request_router")

from triton_llm.scale.prefix_key import chain_of  # noqa: E402
from triton_llm.scale.router import PrefixAwareRouter  # noqa: E402


def _router(imbalance: int = 4) -> PrefixAwareRouter:
    r = PrefixAwareRouter.__new__(PrefixAwareRouter)     # Ray's own state is not needed here
    r._replica_queue_len_cache = SimpleNamespace(get=lambda _rid: None)   # nothing cached by Ray
    r.initialize_state(imbalance=imbalance)
    return r


def _replica(uid: str):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=uid))


def _pending(i: int, chain: list[str]):
    return SimpleNamespace(args=[{"route": chain, "avoid": []}], kwargs={},
                           metadata=SimpleNamespace(internal_request_id=f"req-{i}"))


def test_a_burst_sharing_a_prefix_respects_the_load_bound():
    router = _router(imbalance=4)
    replicas = [_replica("a"), _replica("b")]
    chain = chain_of(list(range(64)), 16)                  # one long shared system prompt
    pendings = [_pending(i, chain) for i in range(16)]
    firsts = [asyncio.run(router.choose_replicas(replicas, p))[0][0].replica_id.unique_id for p in pendings]
    counts = {u: firsts.count(u) for u in ("a", "b")}
    assert max(counts.values()) - min(counts.values()) <= 5, counts   # within imbalance + 1
    assert sum(router.provisional.values()) == 16
    for p, u in zip(pendings, firsts):                     # Ray sends each where it was chosen
        router.on_request_routed(p, _replica(u).replica_id, None)
    assert sum(router.provisional.values()) == 0 and router.ongoing == counts
    for p, u in zip(pendings, firsts):
        router.on_request_completed(_replica(u).replica_id, p.metadata.internal_request_id)
    assert sum(router.ongoing.values()) == 0


def test_a_choice_made_again_or_never_routed_stops_counting():
    router = _router()
    replicas = [_replica("a"), _replica("b")]
    p = _pending(0, chain_of(list(range(32)), 16))
    asyncio.run(router.choose_replicas(replicas, p))
    asyncio.run(router.choose_replicas(replicas, p))       # chosen again: counted once
    assert sum(router.provisional.values()) == 1
    uid, at = router.chosen["req-0"]
    router.chosen["req-0"] = (uid, at - 60)                # the caller gave up long ago
    asyncio.run(router.choose_replicas(replicas, _pending(1, [])))
    assert "req-0" not in router.chosen and sum(router.provisional.values()) == 1   # only req-1
