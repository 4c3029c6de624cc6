"""The scale-out router's pure policies: prefix affinity, the load bound, fallbacks, prefix chains."""
from __future__ import annotations

import pytest

from backend.kv_cache.block_pool import ROOT_HASH, hash_block
from triton_llm.scale.fallback import FallbackPolicy
from triton_llm.scale.metrics import RoutingMetrics
from triton_llm.scale.policy import PrefixAffinityPolicy
from triton_llm.scale.prefix_key import chain_of


def test_chain_is_the_engines_hash_chain_with_the_tenant_salt():
    ids = list(range(40))
    chain = chain_of(ids, 16, "acme")
    assert len(chain) == 2                                   # the partial third block has no hash
    h0 = hash_block(ROOT_HASH, ids[:16], "acme")
    assert chain == [h0.hex(), hash_block(h0, ids[16:32], "acme").hex()]
    assert chain_of(ids, 16, "other") != chain               # tenants never share a prefix
    assert chain_of(ids, 16, "acme", max_blocks=1) == chain[:1]
    assert chain_of(ids[:15], 16) == []


def test_a_conversation_returns_to_the_replica_holding_its_prefix():
    p = PrefixAffinityPolicy(imbalance=2)
    loads = {"a": 0, "b": 0}
    turn1 = chain_of(list(range(32)), 16)
    first = p.choose(turn1, loads)
    assert first.policy == "new"
    p.record(turn1, first.replica)
    other = "b" if first.replica == "a" else "a"
    turn2 = chain_of(list(range(64)), 16)                    # the history grew: same leading blocks
    loads = {first.replica: 1, other: 0}                     # slightly busier still wins
    d = p.choose(turn2, loads)
    assert (d.replica, d.policy, d.matched_blocks) == (first.replica, "prefix", 2)


def test_the_longest_prefix_wins_over_a_shorter_one():
    p = PrefixAffinityPolicy()
    system = chain_of(list(range(16)), 16)
    conv = chain_of(list(range(48)), 16)
    p.record(system, "a")
    p.record(conv, "b")
    d = p.choose(chain_of(list(range(64)), 16), {"a": 0, "b": 0})
    assert (d.replica, d.matched_blocks) == ("b", 3)


def test_a_hot_prefix_cannot_overload_one_replica():
    p = PrefixAffinityPolicy(imbalance=3)
    hot = chain_of(list(range(32)), 16)
    p.record(hot, "a")
    assert p.choose(hot, {"a": 3, "b": 0}).replica == "a"   # within the bound: affinity
    d = p.choose(hot, {"a": 4, "b": 0})                      # past it: the least loaded
    assert (d.replica, d.policy) == ("b", "load_bound")
    p.record(hot, "b")                                       # now both hold it: the lighter one
    assert p.choose(hot, {"a": 2, "b": 1}) .replica == "b"


def test_new_prefixes_converge_and_short_prompts_go_least_loaded():
    p = PrefixAffinityPolicy()                               # min_blocks 2
    shared = chain_of(list(range(32)), 16)
    picks = {p.choose(shared + [f"{i}"], {"a": 0, "b": 0, "c": 0}).replica for i in range(10)}
    assert len(picks) == 1                                   # rendezvous on the second block
    d = p.choose([], {"a": 2, "b": 1, "c": 1})
    assert (d.replica, d.policy) == ("b", "least_loaded")


def test_a_one_block_match_like_a_chat_templates_opening_does_not_pull_new_conversations():
    p = PrefixAffinityPolicy()                               # min_blocks 2
    template = chain_of(list(range(16)), 16)[0]
    where = []
    for c in range(12):                                      # sequential: loads stay 0 / 0
        chain = [template] + [f"conv{c}-{j}" for j in range(3)]
        d = p.choose(chain, {"a": 0, "b": 0})
        assert d.policy == "new"
        p.record(chain, d.replica)
        where.append(d.replica)
        follow = p.choose(chain + [f"conv{c}-turn2"], {"a": 0, "b": 0})   # its next turn stays
        assert (follow.replica, follow.policy) == (d.replica, "prefix")
    assert 0 < where.count("a") < 12, where                  # spread over both replicas
    old = PrefixAffinityPolicy(min_blocks=1)                 # one block is enough: everything piles up
    old.record([template, "conv0-0"], "a")
    assert old.choose([template, "conv1-0"], {"a": 0, "b": 0}) .replica == "a"
    with pytest.raises(ValueError):
        PrefixAffinityPolicy(min_blocks=0)


def test_forgotten_and_absent_replicas_are_never_chosen():
    p = PrefixAffinityPolicy()
    c = chain_of(list(range(32)), 16)
    p.record(c, "a")
    assert p.choose(c, {"b": 0, "c": 0}).policy == "new"    # "a" is not a candidate now
    p.forget("a")
    assert len(p) == 0
    with pytest.raises(ValueError):
        p.choose(c, {})


def test_the_table_is_bounded_lru():
    p = PrefixAffinityPolicy(max_entries=4)
    for i in range(10):
        p.record(chain_of(list(range(i * 100, i * 100 + 32)), 16), "a")
    assert len(p) == 4


def test_fallback_is_opt_in_and_only_under_saturation_or_failure():
    f = FallbackPolicy(max_ongoing_per_replica=4)
    kw = dict(healthy_replicas=2, fallback_available=True)
    assert f.use_fallback(opted_in=False, ongoing=100, **kw) is None
    assert f.use_fallback(opted_in=True, ongoing=8, **kw) is None
    assert f.use_fallback(opted_in=True, ongoing=9, **kw) == "primary_saturated"
    assert f.use_fallback(opted_in=True, ongoing=0, healthy_replicas=0,
                          fallback_available=True) == "no_healthy_primary"
    assert f.use_fallback(opted_in=True, ongoing=0, healthy_replicas=0, fallback_available=False) is None


def test_metrics_count_hits_by_policy():
    m = RoutingMetrics(export=False)
    m.decided("prefix", {"a": 1})
    m.decided("new", {"a": 1, "b": 0})
    m.fell_back("primary_saturated")
    s = m.snapshot()
    assert s["decisions"] == {"prefix": 1, "new": 1} and s["prefix_hit_rate"] == 0.5
    assert s["fallbacks"] == {"primary_saturated": 1} and s["loads"] == {"a": 1, "b": 0}
