"""Each client the shim can serve through satisfies client/interface.py's Protocols, member by
member: present, async exactly when the Protocol's member is, and callable the way the shim calls
it (every Protocol parameter accepted with the same kind; any extra parameter has a default)."""
import pytest

from client.disagg_client import DisaggLLMClient
from client.fake_client import FakeLLMClient
from client.interface import EmbeddingClient, LLMClient, WeightsInfoClient
from client.triton_client import TritonLLMClient
from tests.unit.protocol_check import mismatches
from triton_llm.scale.serve_client import ServeClient

CLIENTS = [TritonLLMClient, DisaggLLMClient, ServeClient, FakeLLMClient]


@pytest.mark.parametrize("cls", CLIENTS, ids=lambda c: c.__name__)
def test_every_client_satisfies_the_shims_interface(cls):
    assert mismatches(cls, LLMClient) == []


@pytest.mark.parametrize("cls, proto", [(TritonLLMClient, EmbeddingClient), (TritonLLMClient, WeightsInfoClient)])
def test_the_optional_capabilities_where_a_client_has_them(cls, proto):
    assert mismatches(cls, proto) == []


def test_the_pairs_client_lacks_embed_and_the_check_says_so():
    # The shim answers /v1/embeddings with an error for such a client (embeddings.py): the check
    # must see the gap rather than pass anything.
    assert mismatches(DisaggLLMClient, EmbeddingClient) == ["embed: missing"]


def test_the_check_rejects_a_client_with_a_wrong_signature():
    class Sync:
        def generate(self, prompt=None, messages=None, *, request_id=None, params=None, stream=True): ...
        def is_ready(self) -> bool: ...                          # not async
        async def context_window(self, model: str) -> int: ...   # a required extra parameter
        async def close(self, *, now) -> None: ...               # a required extra keyword

    assert mismatches(Sync, LLMClient) == [
        "close: extra parameter 'now' without a default",
        "context_window: extra parameter 'model' without a default",
        "is_ready: async in one, not the other",
    ]


def test_runtime_checkable_isinstance_agrees():
    assert isinstance(FakeLLMClient(), LLMClient)
    assert not isinstance(object(), LLMClient)
