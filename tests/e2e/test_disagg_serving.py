"""Prefill/decode disaggregation through the full stack (issue 21): two real tritonservers (engine
role=prefill and role=decode, shared-memory KV connector; the outputs test also over the TCP
connector between the two server processes on 127.0.0.1), tritonclient gRPC through the ``llm``
ensemble, routed by client/disagg_client.py, against the unified session server with the same
engine options (tiny preset, fp32, greedy)."""
from __future__ import annotations

import asyncio
import glob
import json

import pytest

from backend import protocol as P
from backend.serving.disagg_serve import DisaggServers
from client.disagg_client import DisaggLLMClient
from client.errors import InvalidRequestError
from client.triton_client import TritonLLMClient
from tests.conftest import E2E_ENGINE_OPTIONS
from tests.e2e.helpers import metric, scrape, wait_metric
from tests.e2e.settle import settled

WORDS = ("alpha beta gamma delta river stone cloud paper window garden silver orange "
         "music winter engine forest number yellow planet bridge").split()


@pytest.fixture(scope="module")
def pair(tiny_model):
    with DisaggServers(tiny_model, engine_options=E2E_ENGINE_OPTIONS, quiet=True) as servers:
        yield servers


@pytest.fixture(scope="module", params=["shm", "tcp"])
def any_pair(request, tiny_model):
    """The shm pair, then a pair whose KV goes over the TCP connector (the same test for both)."""
    if request.param == "shm":
        yield request.getfixturevalue("pair")
        return
    with DisaggServers(tiny_model, engine_options={**E2E_ENGINE_OPTIONS, "kv_connector": "tcp"},
                       quiet=True) as servers:
        yield servers


def _prompt(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n))


async def _collect(agen) -> dict:
    out: dict[int, dict] = {}
    async for ch in agen:
        c = out.setdefault(ch.index, {"text": "", "ids": [], "finish": None})
        c["text"] += ch.text
        c["ids"] += ch.token_ids
        if ch.finish_reason:
            c["finish"] = ch.finish_reason
    return out


def _requests(stops: dict[int, str]) -> list[dict]:
    """32 mixed requests: shared long prefixes (prefix hits on both sides), chat and plain
    prompts, n=2, stop strings, one-token requests, varied lengths."""
    shared = _prompt(99, 120)
    reqs = []
    for i in range(32):
        params = {"max_tokens": 6 + (i * 5) % 20, "temperature": 0}
        kind = {"prompt": f"{shared} {_prompt(i, 3 + i % 5)}" if i % 4 == 0 else _prompt(i, 5 + (i * 11) % 90)}
        if i % 4 == 1:
            kind = {"messages": [{"role": "user", "content": _prompt(i, 8 + i)}]}
        if i % 8 == 2:
            params["n"] = 2
        if i in stops:
            params["stop"] = [stops[i]]
            params["max_tokens"] = 24
        if i % 8 == 7:
            params["max_tokens"] = 1
        reqs.append({"rid": f"dis-{i}", "params": params, **kind})
    return reqs


async def _run_all(client, reqs, concurrency: int = 4) -> dict[str, dict]:
    sem = asyncio.Semaphore(concurrency)

    async def one(r):
        async with sem:
            agen = client.generate(r.get("prompt"), r.get("messages"), request_id=r["rid"], params=r["params"])
            return r["rid"], await _collect(agen)

    return dict(await asyncio.gather(*(one(r) for r in reqs)))


def test_outputs_identical_to_unified(triton_server, any_pair):
    pair = any_pair

    async def main():
        unified = TritonLLMClient(triton_server.grpc_url)
        disagg = DisaggLLMClient(pair.prefill.grpc_url, pair.decode.grpc_url)
        try:
            # stop strings taken from the middle of the unified output, so they do cut
            stop_ids = (3, 6, 11, 14, 19, 27)
            probe = await _run_all(unified, [{"rid": f"probe-{i}", "prompt": _prompt(i, 30),
                                              "params": {"max_tokens": 16, "temperature": 0}} for i in stop_ids])
            stops = {}
            for i in stop_ids:
                text = probe[f"probe-{i}"][0]["text"]
                if len(text) >= 8:
                    stops[i] = text[len(text) // 2:len(text) // 2 + 2]
            reqs = _requests(stops)
            for i in stops:                       # same prompt as the probe: the stop string occurs
                reqs[i].pop("messages", None)
                reqs[i]["prompt"] = _prompt(i, 30)
            want = await _run_all(unified, reqs)
            got = await _run_all(disagg, reqs)
            return want, got, stops, disagg.handovers, disagg.kept
        finally:
            await unified.close()
            await disagg.close()

    want, got, stops, handovers, kept = asyncio.run(main())
    assert got == want
    assert len(stops) >= 4 and all(want[f"dis-{i}"][0]["finish"] == "stop" for i in stops)
    assert sum(len(v) == 2 for v in want.values()) == 4                     # n=2 requests
    assert handovers >= 20 and kept >= 8                                     # n=2, one-token: kept
    # one snapshot of the whole poll: the counters are written one IPC each (tests/e2e/settle.py)
    snap = settled(lambda: scrape(pair.decode), ready=lambda s: metric(
        s, "llm_disagg_handovers_total", role="decode", outcome="admitted") >= handovers)
    assert metric(snap, "llm_disagg_handovers_total", role="decode", outcome="recomputed") == 0
    assert metric(snap, "llm_disagg_prefix_hit_blocks_total", role="decode") > 0      # not fetched again
    assert metric(snap, "llm_disagg_transfer_bytes_total", role="decode") > 0
    assert metric(snap, "llm_disagg_handover_seconds_count", role="decode") >= handovers
    # the prefill engine's counters reach Prometheus in batches: wait for them too
    pre, _ = wait_metric(pair.prefill, lambda s: metric(s, "llm_disagg_staged_transfers", role="prefill") == 0
                         and metric(s, "llm_disagg_handovers_total", role="prefill", outcome="handed_over")
                         >= handovers, timeout=60)
    assert metric(pre, "llm_disagg_staged_transfers", role="prefill") == 0
    assert metric(pre, "llm_disagg_handovers_total", role="prefill", outcome="handed_over") >= handovers


def _freed(server, role: str) -> None:
    wait_metric(server, lambda s: metric(s, "llm_kv_cache_usage_ratio") == 0
                and metric(s, "llm_num_requests_running") == 0
                and metric(s, "llm_disagg_staged_transfers", role=role) == 0
                and metric(s, "llm_disagg_queue_depth", role=role) == 0, timeout=60)


def test_cancel_during_prefill_transfer_and_decode_frees_both_sides(pair):
    long_prompt = list(range(5, 5 + 480))
    params = {"max_tokens": 200, "min_tokens": 200, "temperature": 0}

    async def main():
        disagg = DisaggLLMClient(pair.prefill.grpc_url, pair.decode.grpc_url)
        prefill = TritonLLMClient(pair.prefill.grpc_url)
        try:
            # 1. during prefill: queued behind other long prompts on the prefill server, the
            #    consumer goes away before anything arrived
            before = settled(lambda: scrape(pair.prefill))     # earlier aborts all written
            busy = [asyncio.create_task(_collect(disagg.generate_ids(
                [(j * 7 + k * 131) % 3000 + 5 for j in range(480)], params={"max_tokens": 2, "temperature": 0})))
                for k in range(6)]
            await asyncio.sleep(0.05)
            task = asyncio.create_task(_collect(disagg.generate_ids(long_prompt, request_id="c-pre",
                                                                    params=params)))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.gather(*busy)
            await disagg.wait_aborts()
            aborted = metric(before, "llm_requests_aborted_total") + 1      # polled counters
            wait_metric(pair.prefill, lambda s: metric(s, "llm_requests_aborted_total") >= aborted, timeout=60)
            assert metric(settled(lambda: scrape(pair.prefill)), "llm_requests_aborted_total") == aborted
            _freed(pair.prefill, "prefill")
            _freed(pair.decode, "decode")

            # 2. during transfer: the record is out, its KV staged on the prefill host, and the
            #    continuation never reaches the decode server
            chunks = [c async for c in prefill.generate_ids(long_prompt, request_id="c-xfer", params=params)]
            assert [c.finish_reason for c in chunks] == [P.FINISH_HANDOVER]
            record = json.loads(chunks[0].metrics[P.HANDOVER])
            name = record["locator"]["name"]
            assert glob.glob(f"/dev/shm/{name}")                    # staged ...
            wait_metric(pair.prefill, lambda s: metric(s, "llm_disagg_staged_transfers", role="prefill") == 1
                        and metric(s, "llm_kv_cache_usage_ratio") == 0, timeout=60)  # ... pool already free
            assert await disagg.abort("c-xfer")
            assert not glob.glob(f"/dev/shm/{name}")                # released by the prefill server
            _freed(pair.prefill, "prefill")

            # 3. during decode: a few tokens streamed from the decode server, then the consumer stops
            before = settled(lambda: scrape(pair.decode))      # earlier aborts all written
            got = 0
            agen = disagg.generate_ids(long_prompt, request_id="c-dec", params=params)
            async for ch in agen:
                got += len(ch.token_ids)
                if got >= 3:
                    break
            await agen.aclose()                  # as the shim does when its client goes away
            await disagg.wait_aborts()
            # the counters are polled (0.1 s): wait for the abort to show before checking the
            # gauges, which were 0 before this request too
            aborted = metric(before, "llm_requests_aborted_total") + 1
            wait_metric(pair.decode, lambda s: metric(s, "llm_requests_aborted_total") >= aborted, timeout=60)
            assert metric(settled(lambda: scrape(pair.decode)), "llm_requests_aborted_total") == aborted
            _freed(pair.decode, "decode")
            _freed(pair.prefill, "prefill")
            assert got < 200
        finally:
            await disagg.close()
            await prefill.close()

    asyncio.run(main())


def test_bad_handover_is_a_clear_error(triton_server, pair):
    async def main():
        prefill = TritonLLMClient(pair.prefill.grpc_url)
        decode = TritonLLMClient(pair.decode.grpc_url)
        unified = TritonLLMClient(triton_server.grpc_url)
        try:
            chunks = [c async for c in prefill.generate_ids([7] * 40, params={"max_tokens": 8, "temperature": 0})]
            record = chunks[-1].metrics[P.HANDOVER]
            with pytest.raises(InvalidRequestError, match="differs from input_ids"):
                await _collect(decode.generate_ids([8] * 40, params={"max_tokens": 8, P.HANDOVER: record}))
            with pytest.raises(InvalidRequestError, match="bad hand-over record"):
                await _collect(decode.generate_ids([7] * 40, params={"max_tokens": 8, P.HANDOVER: "{\"x\": 1}"}))
            with pytest.raises(InvalidRequestError, match="not role=decode"):
                await _collect(unified.generate_ids([7] * 40, params={"max_tokens": 8, P.HANDOVER: record}))
            # forged records: each is that request's 400 (never the engine thread's exception)
            good = json.loads(record)
            for over in ({"queue_time": "soon"}, {"generator_state": "AAAA"}, {"first_token": 10 ** 9},
                         {"num_kv_tokens": 3}, {"salt": "tenant:someone-else"},
                         {"locator": {**good["locator"], "shape": [10 ** 6, *good["block_shape"]]}}):
                with pytest.raises(InvalidRequestError, match="bad hand-over record") as err:
                    await _collect(decode.generate_ids([7] * 40, params={"max_tokens": 8,
                                                                        P.HANDOVER: json.dumps({**good, **over})}))
                assert err.value.param == P.HANDOVER
            # the good record still works afterwards: the decode server continues the stream
            out = await _collect(decode.generate_ids([7] * 40, params={"max_tokens": 8, "temperature": 0,
                                                                       P.HANDOVER: record}))
            ref = await _collect(unified.generate_ids([7] * 40, params={"max_tokens": 8, "temperature": 0}))
            assert out[0]["ids"] == ref[0]["ids"] and len(ref[0]["ids"]) == 8
            assert pair.alive()                         # both servers still serving
        finally:
            for c in (prefill, decode, unified):
                await c.close()

    asyncio.run(main())
    _freed(pair.decode, "decode")


def test_a_second_tenant_cannot_take_the_first_tenants_kv(pair):
    """Tenant beta replays tenant alpha's hand-over record to the decode server: the decode side
    fetches as beta (the caller's salt), the transfer is refused and stays alpha's, and beta's
    request is recomputed (same tokens: it had to send the same prompt)."""
    prompt = [(9 * k) % 3000 + 5 for k in range(60)]
    params = {"max_tokens": 6, "temperature": 0}

    async def main():
        prefill = TritonLLMClient(pair.prefill.grpc_url)
        decode = TritonLLMClient(pair.decode.grpc_url)
        try:
            chunks = [c async for c in prefill.generate_ids(prompt, request_id="ten-a",
                                                            params={**params, P.TENANT: "alpha"})]
            record = chunks[-1].metrics[P.HANDOVER]
            before = settled(lambda: scrape(pair.decode))
            out = await _collect(decode.generate_ids(prompt, request_id="ten-a",
                                                     params={**params, P.TENANT: "beta", P.HANDOVER: record}))
            recomputed = metric(before, "llm_disagg_handovers_total", role="decode", outcome="recomputed") + 1
            wait_metric(pair.decode, lambda s: metric(s, "llm_disagg_handovers_total", role="decode",
                                                      outcome="recomputed") >= recomputed, timeout=60)
            wait_metric(pair.prefill, lambda s: metric(s, "llm_disagg_staged_transfers", role="prefill") == 1,
                        timeout=60)                 # still staged: beta neither read nor released it
            ref = await _collect(decode.generate_ids(prompt, params={**params, P.TENANT: "beta"}))
            assert out[0]["ids"] == ref[0]["ids"] and len(out[0]["ids"]) == 6
            assert await prefill.abort("ten-a", tenant="alpha")
        finally:
            await prefill.close()
            await decode.close()

    asyncio.run(main())
    _freed(pair.prefill, "prefill")
