"""HTTP fuzzing of the real stack (shim process + tritonserver on the tiny model), bounded in time.

Two generators of bad requests, run against every route of the shim's own OpenAPI schema:

- schemathesis' negative mode: bodies, paths and queries that violate the schema;
- hand-targeted hypothesis strategies: a valid body with one field made wrong (out of int64 or
  its range, non-finite, the wrong type, too long, too many), broken bytes, bad keys.

Every bad request must get a 4xx with its API's error body (Anthropic's on /v1/messages, OpenAI's
elsewhere; /v1/responses and /v1/messages have their own targeted bodies too): no 5xx, no hang (a per-request
timeout), no process dies. Afterwards a reference request's output is unchanged and the engine
is idle (no running requests, KV usage 0). At least 500 requests must have been refused.
"""
from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from client.fake_client import FakeLLMClient
from client.shim import ShimSettings, create_app
from tests.e2e.shim_fixtures import KEY, MODEL, start_shim, stop_shim, wait_metric

pytestmark = pytest.mark.e2e

AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT = 60.0                    # a request that takes longer is a hang
MIN_REFUSED = 500
MAX_TOKENS_CAP = 8                # accepted (valid after all) requests stay cheap
EXAMPLES = {"POST /v1/chat/completions": 110, "POST /v1/completions": 110, "POST /v1/responses": 60,
            "POST /v1/messages": 60}
OTHER_EXAMPLES = 12

tally: Counter = Counter()
failures: list[str] = []


@pytest.fixture(scope="module")
def stack(triton_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    s = start_shim(triton_server, tmp, extra_args=("--chat-db", str(tmp / "chat.sqlite"),
                                                   "--max-body-bytes", str(256 * 1024)))
    yield s, triton_server
    stop_shim(s.proc)


def reference(url: str) -> str:
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=TIMEOUT,
                   json={"model": MODEL, "prompt": "The reference prompt", "max_tokens": 12,
                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def check(r: httpx.Response | None, what: str, exc: BaseException | None = None, path: str = "") -> None:
    """Record the outcome; a 5xx, a hang, an error body not in the route's API shape (Anthropic's
    on /v1/messages, OpenAI's elsewhere) is a failure."""
    if r is None:
        tally["hang/error"] += 1
        failures.append(f"{what}: no answer ({type(exc).__name__}: {exc})")
        return
    if r.status_code >= 500:
        failures.append(f"{what}: {r.status_code} {r.text[:300]}")
    elif r.status_code >= 400:
        tally["refused"] += 1
        tally[str(r.status_code)] += 1
        try:
            body = r.json()
            if path.startswith("/v1/messages"):
                assert set(body) == {"type", "error"} and body["type"] == "error"
                assert set(body["error"]) == {"type", "message"} and isinstance(body["error"]["message"], str)
            else:
                err = body["error"]
                assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
        except Exception:                     # noqa: BLE001 -- recorded as a failure
            failures.append(f"{what}: {r.status_code} without its API's error body: {r.text[:300]}")
    else:
        tally["accepted"] += 1
        if "text/event-stream" in r.headers.get("content-type", ""):
            last = [e for e in r.text.split("\n\n") if e.strip()][-1:]
            ends = ("data: [DONE]", "event: response.completed", "event: response.incomplete",
                    "event: response.failed", "event: message_stop", "event: error")
            if not last or not (last[0].startswith(ends) or '"error"' in last[0]):
                failures.append(f"{what}: a stream that neither finished nor failed: {r.text[-300:]}")


def send(http: httpx.Client, method: str, path: str, what: str, **kwargs) -> None:
    try:
        r = http.request(method, path, timeout=TIMEOUT, **kwargs)
    except httpx.LocalProtocolError:
        tally["unsendable"] += 1              # the HTTP library itself refuses (e.g. a header)
        return
    except httpx.HTTPError as exc:
        check(None, what, exc, path)
        return
    check(r, what, path=path)


def cheap(body, path: str = ""):
    """Keep a generation that turns out valid short: cap max_tokens when it is a sane integer."""
    if isinstance(body, dict):
        body = dict(body)
        body.setdefault("max_output_tokens" if path == "/v1/responses" else "max_tokens", 4)
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > MAX_TOKENS_CAP:
                body[key] = MAX_TOKENS_CAP
    return body


def openapi_schema() -> dict:
    """The schema of the very app the shim process serves (its /openapi.json is switched off)."""
    app = create_app(ShimSettings(model_name=MODEL, api_keys={KEY: "acme"}, chat_db_path=":memory:"),
                     client=FakeLLMClient())
    return app.openapi()


def run_schemathesis(http: httpx.Client) -> None:
    schema = schemathesis.openapi.from_dict(openapi_schema())
    for result in schema.get_all_operations():
        op = result.ok()
        name = f"{op.method.upper()} {op.path}"
        strategy = op.as_strategy(generation_mode=GenerationMode.NEGATIVE)

        @settings(max_examples=EXAMPLES.get(name, OTHER_EXAMPLES), deadline=None, database=None,
                  derandomize=True, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def fuzz(case):
            kwargs: dict = {"params": case.query or None,
                            "headers": {**{k: str(v) for k, v in (case.headers or {}).items()}, **AUTH}}
            body = case.body
            if isinstance(body, (bytes, bytearray)):
                kwargs["content"] = bytes(body)
                kwargs["headers"]["content-type"] = case.media_type or "application/json"
            elif body is not None and not type(body).__name__ == "NotSet":
                kwargs["content"] = json.dumps(cheap(body, op.path), allow_nan=True).encode("utf-8", "surrogatepass")
                kwargs["headers"]["content-type"] = "application/json"
            try:
                path = case.formatted_path
            except Exception:                 # noqa: BLE001 -- a path schemathesis cannot format
                return
            tally["schemathesis"] += 1
            send(http, case.method, path, f"schemathesis {name} {str(case.body)[:120]!r}", **kwargs)

        try:
            fuzz()
        except Unsatisfiable:
            pass                              # nothing about this route can be made invalid


# -- hand-targeted bad bodies ------------------------------------------------------------------
INT_FIELDS = ["n", "max_tokens", "seed", "top_k", "min_tokens", "priority", "logprobs",
              "top_logprobs", "max_completion_tokens"]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty"]
huge = st.one_of(st.integers(min_value=2 ** 63, max_value=2 ** 200),
                 st.integers(min_value=-(2 ** 200), max_value=-(2 ** 63) - 1),
                 st.sampled_from([10 ** 9, 2 ** 31, 2 ** 32, -1, -(2 ** 31) - 1]))
junk = st.one_of(st.text(max_size=20), st.booleans(), st.none(), st.lists(st.integers(), max_size=3),
                 st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
                 st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308, -1e308]))


@st.composite
def bad_generation(draw):
    chat = draw(st.booleans())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict = ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]} if chat
                  else {"model": MODEL, "prompt": "hi"})
    body["max_tokens"] = 4
    body["stream"] = draw(st.booleans())
    kind = draw(st.sampled_from(["int", "float", "stop", "prompt", "messages", "model", "type"]))
    if kind == "int":
        body[draw(st.sampled_from(INT_FIELDS))] = draw(huge)
    elif kind == "float":
        body[draw(st.sampled_from(FLOAT_FIELDS))] = draw(st.one_of(
            st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308]),
            st.floats(min_value=101, max_value=1e30), st.floats(max_value=-3, min_value=-1e30)))
    elif kind == "stop":
        body["stop"] = draw(st.one_of(st.lists(st.text(min_size=1, max_size=4), min_size=5, max_size=9),
                                      st.text(min_size=257, max_size=400).map(lambda s: [s]),
                                      st.lists(st.integers(), min_size=1, max_size=3)))
    elif kind == "prompt":
        path = "/v1/completions"
        body.pop("messages", None)
        body["prompt"] = draw(st.one_of(st.just([]), st.lists(st.just("p"), min_size=33, max_size=40),
                                        st.lists(st.integers(), min_size=1, max_size=3), st.none(),
                                        st.just("x" * 20000)))
    elif kind == "messages":
        path = "/v1/chat/completions"
        body.pop("prompt", None)
        body["messages"] = draw(st.one_of(
            st.just([]), st.none(), st.text(max_size=10),
            st.lists(st.fixed_dictionaries({"content": st.text(max_size=5)}), min_size=1, max_size=2),
            st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                            "content": st.one_of(st.integers(), st.lists(st.integers(), min_size=1))}),
                     min_size=1, max_size=2),
            st.lists(st.fixed_dictionaries({"role": st.text(max_size=8).filter(
                lambda r: r not in ("user", "system", "assistant", "tool")), "content": st.just("x")}),
                min_size=1, max_size=2)))
    elif kind == "model":
        body["model"] = draw(st.one_of(st.text(max_size=30).filter(lambda m: m != MODEL), st.integers(), st.none()))
    else:
        field = draw(st.sampled_from(INT_FIELDS + ["stream", "ignore_eos", "stop_token_ids", "stream_options"]))
        body[field] = draw(st.one_of(st.text(min_size=1, max_size=10).filter(lambda s: not s.strip().lstrip("-").isdigit()),
                                     st.dictionaries(st.text(max_size=3), st.text(max_size=3), min_size=1, max_size=2)))
    return path, json.dumps(body, allow_nan=True).encode()


@st.composite
def bad_other_api(draw):
    """/v1/responses and /v1/messages: a wrong type, an unknown field, an unsupported part, too much."""
    responses = draw(st.booleans())
    path = "/v1/responses" if responses else "/v1/messages"
    body: dict = ({"model": MODEL, "input": "hi", "max_output_tokens": 4} if responses else
                  {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    body["stream"] = draw(st.booleans())
    kind = draw(st.sampled_from(["type", "unknown", "part", "big", "int"]))
    if kind == "type":
        field = draw(st.sampled_from(["input", "instructions", "tools", "text", "temperature", "top_p"] if responses
                                     else ["messages", "system", "tools", "stop_sequences", "temperature", "top_k"]))
        body[field] = draw(st.one_of(st.integers(), st.text(min_size=1, max_size=5).filter(lambda t: not t.strip().isdigit()),
                                     st.lists(st.integers(), min_size=1, max_size=2)).filter(
            lambda v: not (isinstance(v, str) and field in ("input", "instructions", "system"))))
    elif kind == "unknown":
        body[draw(st.text(alphabet="abcdefghij_", min_size=3, max_size=10))] = 1
    elif kind == "part":
        part = draw(st.sampled_from([{"type": "image", "source": {}}, {"type": "input_image", "image_url": "x"},
                                     {"type": "tool_result"}, {"type": "document"}, {"type": 5}, "str", 7]))
        if responses:
            body["input"] = [{"role": "user", "content": [part]}] if draw(st.booleans()) else [part]
        else:
            body["messages"] = [{"role": draw(st.sampled_from(["user", "assistant", "system"])), "content": [part]}]
    elif kind == "big":
        big = "x" * draw(st.sampled_from([20000, 200_000]))
        if responses:
            body["input"] = big
        else:
            body["messages"] = [{"role": "user", "content": big}]
    else:
        body["max_output_tokens" if responses else "max_tokens"] = draw(st.one_of(huge, st.just(0)))
    return path, json.dumps(body, allow_nan=True).encode()


@st.composite
def bad_bytes(draw):
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/api/conversations",
                                 "/v1/responses", "/v1/messages"]))
    body = draw(st.one_of(
        st.binary(max_size=200), st.just(b""), st.just(b"null"), st.just(b"[]"), st.just(b'"x"'),
        st.just(b"[" * 5000 + b"]" * 5000), st.just(b'{"model": "' + MODEL.encode() + b'", "prompt": "\\ud800"}'),
        st.just(b'{"title": "\\udc00"}'), st.just(b"x" * (300 * 1024)),
        st.text(max_size=50).map(lambda t: t.encode("utf-8"))))
    return path, body


def run_targeted(http: httpx.Client, url: str) -> None:
    @settings(max_examples=220, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(req=bad_generation())
    def generation(req):
        path, body = req
        tally["targeted"] += 1
        send(http, "POST", path, f"targeted {body[:160]!r}", content=body,
             headers={**AUTH, "content-type": "application/json"})

    @settings(max_examples=70, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(req=bad_bytes())
    def raw(req):
        path, body = req
        tally["targeted"] += 1
        send(http, "POST", path, f"bytes {body[:80]!r}", content=body,
             headers={**AUTH, "content-type": "application/json"})

    @settings(max_examples=30, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(header=st.one_of(st.none(), st.just("Bearer"), st.just("Bearer "), st.just("Basic abc"),
                            st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=40)
                            .map(lambda t: "Bearer " + t)),
           path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/models", "/api/conversations",
                                 "/v1/messages"]))
    def keys(header, path):
        tally["targeted"] += 1
        headers = {"content-type": "application/json"} | ({"Authorization": header} if header else {})
        method = "GET" if path == "/v1/models" else "POST"
        send(http, method, path, f"auth {header!r}", headers=headers,
             content=json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode())

    @settings(max_examples=80, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(req=bad_other_api())
    def other_api(req):
        path, body = req
        tally["targeted"] += 1
        headers = {"content-type": "application/json"} | (
            {"x-api-key": KEY} if path == "/v1/messages" else AUTH)
        send(http, "POST", path, f"targeted {body[:160]!r}", content=body, headers=headers)

    generation()
    other_api()
    raw()
    keys()


def test_http_fuzz(stack):
    shim, triton = stack
    start = time.monotonic()
    ref = reference(shim.url)
    with httpx.Client(base_url=shim.url) as http:
        run_targeted(http, shim.url)
        run_schemathesis(http)
    took = time.monotonic() - start
    print(f"\nHTTP fuzz: {dict(tally)} in {took:.0f} s")
    assert not failures, f"{len(failures)} bad answers, e.g.:\n" + "\n".join(failures[:15])
    assert shim.proc.poll() is None, "the shim died"
    assert triton.alive(), "tritonserver died"
    assert tally["refused"] >= MIN_REFUSED, dict(tally)
    assert wait_metric(shim.metrics_url, "llm_num_requests_running", lambda v: v == 0, timeout=60) == 0
    assert wait_metric(shim.metrics_url, "llm_kv_cache_usage_ratio", lambda v: v == 0, timeout=30) == 0
    assert reference(shim.url) == ref
