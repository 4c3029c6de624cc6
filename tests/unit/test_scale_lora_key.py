"""Prefix-aware Ray routing keys include the LoRA adapter: one conversation on adapter A and one on
B (or on the base model) with the same prompt are different prefixes to the router, as their KV is
different to the engine; the same adapter keeps its affinity."""
from __future__ import annotations

import asyncio

import pytest

from triton_llm.scale.policy import PrefixAffinityPolicy
from triton_llm.scale.prefix_key import PrefixKeyer, chain_of
from tests.conftest import model_dir

IDS = list(range(48))


def test_the_chain_is_keyed_by_adapter_and_tenant():
    base, on_a, on_b = chain_of(IDS, 16), chain_of(IDS, 16, lora="a"), chain_of(IDS, 16, lora="b")
    assert len(base) == len(on_a) == len(on_b) == 3
    assert not set(base) & set(on_a) and not set(on_a) & set(on_b) and not set(base) & set(on_b)
    assert chain_of(IDS, 16, lora="a") == on_a                      # stable: the same adapter matches
    assert chain_of(IDS, 16, lora="") == base                       # "" is the base model, as on the wire
    tenant_a = chain_of(IDS, 16, "acme", lora="a")
    assert tenant_a != on_a and tenant_a != chain_of(IDS, 16, "acme")
    assert chain_of(IDS, 16, "acme", lora="b") != tenant_a


def test_affinity_does_not_cross_adapters():
    p = PrefixAffinityPolicy()
    on_a = chain_of(IDS, 16, lora="a")
    p.record(on_a, "r1")
    d = p.choose(chain_of(IDS + list(range(16)), 16, lora="a"), {"r1": 0, "r2": 0})
    assert (d.replica, d.policy, d.matched_blocks) == ("r1", "prefix", 3)
    d = p.choose(chain_of(IDS, 16, lora="b"), {"r1": 1, "r2": 0})   # same prompt, other adapter
    assert d.policy != "prefix" and d.matched_blocks == 0
    d = p.choose(chain_of(IDS, 16), {"r1": 1, "r2": 0})             # and the base model
    assert d.policy != "prefix" and d.matched_blocks == 0


def test_the_keyer_renders_once_and_keys_by_adapter():
    keyer = PrefixKeyer(model_dir("tiny"), block_size=4)
    messages = [{"role": "system", "content": "You answer questions about the weather in Paris."},
                {"role": "user", "content": "Will it rain tomorrow afternoon?"}]
    base = keyer.chain(messages=messages, tenant="acme")
    on_a, on_b = keyer.chain(messages=messages, tenant="acme", lora="a"), keyer.chain(messages=messages, tenant="acme", lora="b")
    assert len(base) == len(on_a) == len(on_b) > 2
    assert on_a != on_b and base not in (on_a, on_b) and not set(on_a) & set(on_b)
    assert keyer.chain(messages=messages, tenant="acme", lora="a") == on_a
    assert keyer.chain(messages=messages, tenant="acme", lora=None) == base


def test_the_ingress_keys_requests_by_their_lora_parameter():
    """ServeClient computes the route from the request parameters the shim set (``lora`` from the
    OpenAI ``model`` field), so two adapters' requests carry different routes to the router."""
    pytest.importorskip("ray")
    from triton_llm.scale.serve_client import ServeClient

    keyer = PrefixKeyer(model_dir("tiny"), block_size=4)
    client = ServeClient(None, keyer=keyer)
    prompt = "The same long prompt for two adapters: " * 4

    def route(params):
        return asyncio.run(client._route(prompt, None, params))
    on_a, on_b, base = route({"lora": "a", "tenant": "acme"}), route({"lora": "b", "tenant": "acme"}), route({"tenant": "acme"})
    assert on_a == keyer.chain(prompt=prompt, tenant="acme", lora="a") and len(on_a) > 2
    assert on_b == keyer.chain(prompt=prompt, tenant="acme", lora="b") and not set(on_a) & set(on_b)
    assert base == keyer.chain(prompt=prompt, tenant="acme") and not set(base) & set(on_a)
