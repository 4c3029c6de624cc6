"""Locust users for the serving stack.

    ShimChatUser      POST /v1/chat/completions with stream=true on the OpenAI shim, read as raw SSE
    TritonGrpcUser    one tritonclient gRPC stream per user against the ``llm`` ensemble

Besides each request's own entry, both record ``time_to_first_token`` (request sent -> first chunk
with content) and ``inter_token_latency`` (gap between consecutive chunks with content) as their own
Locust entries, and ``end_to_end`` for the whole stream, so the CSV stats carry their percentiles.

    locust -f load/locustfile.py --headless -u 8 -r 8 -t 60s \
        --host http://127.0.0.1:9000 --triton-grpc 127.0.0.1:8001 --csv load/results/locust
    locust -f load/locustfile.py ShimChatUser --host ...        # one kind of user only

Prompts are corpus text of --prompt-tokens tokens (load/workloads.py), seeded per user;
generation is greedy with ignore_eos and --max-tokens tokens.
"""
from __future__ import annotations

import json
import pathlib
import queue
import random
import sys
import time
import uuid

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # the repository root

import grpc.experimental.gevent as grpc_gevent  # noqa: E402
from locust import HttpUser, User, between, events, task  # noqa: E402

# Locust runs users as greenlets: make grpc's blocking calls cooperative before any channel exists.
grpc_gevent.init_gevent()

TTFT, ITL, E2E = "time_to_first_token", "inter_token_latency", "end_to_end"


@events.init_command_line_parser.add_listener
def _add_arguments(parser):
    parser.add_argument("--triton-grpc", default="127.0.0.1:8001", help="Triton gRPC host:port")
    parser.add_argument("--api-key", default="", help="Bearer key for the shim")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--stream-timeout", type=float, default=120.0)


def _messages(user_seed: int, n_tokens: int) -> list[dict]:
    from load.workloads import text_of_tokens

    rng = random.Random(user_seed)
    return [{"role": "user", "content": f"[{uuid.uuid4().hex[:8]}] " + text_of_tokens(rng, n_tokens)}]


class _Timer:
    """Fires TTFT / ITL events at chunks with content, and E2E at the end."""

    def __init__(self, user: User, kind: str) -> None:
        self.fire = user.environment.events.request.fire
        self.kind = kind
        self.t0 = time.perf_counter()
        self.last: float | None = None
        self.chunks = 0

    def content(self) -> None:
        now = time.perf_counter()
        name, since = (TTFT, self.t0) if self.last is None else (ITL, self.last)
        self.fire(request_type=self.kind, name=name, response_time=(now - since) * 1000.0,
                  response_length=0, exception=None, context={})
        self.last = now
        self.chunks += 1

    def end(self, exception: Exception | None, length: int) -> None:
        self.fire(request_type=self.kind, name=E2E, response_time=(time.perf_counter() - self.t0) * 1000.0,
                  response_length=length, exception=exception, context={})


class ShimChatUser(HttpUser):
    """Streaming chat completions through the OpenAI shim."""
    wait_time = between(0.0, 0.2)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.opts = opts
        self.headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
        self.seed = random.randrange(1 << 30)
        r = self.client.get("/v1/models", headers=self.headers, name="/v1/models")
        self.model = r.json()["data"][0]["id"] if r.ok else "llm"

    @task
    def chat_stream(self) -> None:
        self.seed += 1
        body = {"model": self.model, "messages": _messages(self.seed, self.opts.prompt_tokens),
                "max_tokens": self.opts.max_tokens, "stream": True, "temperature": 0, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        timer = _Timer(self, "SSE")
        error, tokens, done = None, 0, False
        with self.client.post("/v1/chat/completions", json=body, headers=self.headers, stream=True,
                              catch_response=True, name="/v1/chat/completions (stream)",
                              timeout=self.opts.stream_timeout) as resp:
            try:
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
                for raw in resp.iter_lines():
                    line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        raise RuntimeError(f"stream error: {event['error']}")
                    if any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
                        timer.content()
                    if event.get("usage"):
                        tokens = event["usage"].get("completion_tokens", tokens)
                if not done:
                    raise RuntimeError("stream ended without data: [DONE]")
                if timer.chunks == 0:
                    raise RuntimeError("no content streamed")
                resp.success()
            except Exception as exc:        # noqa: BLE001 -- every failure is a Locust failure
                error = exc
                resp.failure(exc)
        timer.end(error, tokens)


class TritonGrpcUser(User):
    """Streaming generation from the ``llm`` ensemble over one gRPC stream per user."""
    wait_time = between(0.0, 0.2)

    def on_start(self) -> None:
        import tritonclient.grpc as grpcclient

        self.opts = self.environment.parsed_options
        self.seed = random.randrange(1 << 30)
        self.responses: queue.Queue = queue.Queue()
        self.grpc = grpcclient.InferenceServerClient(self.opts.triton_grpc)
        self.grpc.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def on_stop(self) -> None:
        self.grpc.stop_stream(cancel_requests=True)
        self.grpc.close()

    @task
    def generate_stream(self) -> None:
        import numpy as np
        import tritonclient.grpc as grpcclient

        self.seed += 1
        rid = uuid.uuid4().hex
        inp = grpcclient.InferInput("messages", [1], "BYTES")
        inp.set_data_from_numpy(np.array([json.dumps(_messages(self.seed, self.opts.prompt_tokens)).encode()],
                                         dtype=object))
        params = {"stream": True, "max_tokens": self.opts.max_tokens, "temperature": 0.0, "ignore_eos": True}
        timer = _Timer(self, "gRPC")
        error, tokens = None, 0
        try:
            self.grpc.async_stream_infer("llm", [inp], request_id=rid, parameters=params)
            deadline = time.monotonic() + self.opts.stream_timeout
            while True:
                try:
                    result, err = self.responses.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(f"no response within {self.opts.stream_timeout}s") from None
                if err is not None:
                    raise RuntimeError(str(err))
                if result.get_response().id != rid:           # a late response of an earlier request
                    continue
                ids = result.as_numpy("output_ids")
                if (ids is not None and ids.size) or result.as_numpy("text_output")[0]:
                    timer.content()
                finish = result.as_numpy("finish_reason")[0].decode()
                if finish:
                    tokens = int(result.as_numpy("completion_tokens")[0])
                    if finish not in ("stop", "length"):
                        raise RuntimeError(f"finish_reason={finish}")
                    break
        except Exception as exc:            # noqa: BLE001
            error = exc
        timer.end(error, tokens)             # the request's own entry: gRPC end_to_end
