"""Small tritonclient gRPC helpers for the e2e tests (one stream per call, FINAL tracked exactly).

    res = generate(server, "llm", text="hi", max_tokens=8, temperature=0)
    res.text, res.ids, res.finish_reason, res.responses, res.finals, res.error
"""
from __future__ import annotations

import json
import queue
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient

from backend.outputs import decode_delta
from load.counters import labelled, scrape_text


@dataclass
class Choice:
    text: str = ""
    ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    final: dict = field(default_factory=dict)     # counts and metrics of the choice's last response
    logprobs: list = field(default_factory=list)


@dataclass
class Result:
    request_id: str
    choices: dict[int, Choice] = field(default_factory=dict)
    responses: int = 0           # responses with outputs
    finals: int = 0              # responses flagged FINAL (must be exactly 1)
    error: str | None = None

    @property
    def text(self) -> str:
        return self.choices[0].text if self.choices else ""

    @property
    def ids(self) -> list[int]:
        return self.choices[0].ids if self.choices else []

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason if self.choices else ""


def bytes_input(name: str, text: str) -> grpcclient.InferInput:
    inp = grpcclient.InferInput(name, [1], "BYTES")
    inp.set_data_from_numpy(np.array([text.encode("utf-8")], dtype=np.object_))
    return inp


def ids_input(ids: list[int]) -> grpcclient.InferInput:
    inp = grpcclient.InferInput("input_ids", [len(ids)], "INT32")
    inp.set_data_from_numpy(np.array(ids, dtype=np.int32))
    return inp


def make_inputs(*, text=None, messages=None, input_ids=None) -> list:
    inputs = []
    if text is not None:
        inputs.append(bytes_input("text_input", text))
    if messages is not None:
        inputs.append(bytes_input("messages", messages if isinstance(messages, str) else json.dumps(messages)))
    if input_ids is not None:
        inputs.append(ids_input(input_ids))
    return inputs


def _scalar(result, name):
    arr = result.as_numpy(name)
    if arr is None or arr.size == 0:
        return None
    v = arr.reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else int(v)


class Stream:
    """One gRPC stream carrying one generation request (plus, optionally, control requests)."""

    def __init__(self, server, tokenizer=None) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.q: queue.Queue = queue.Queue()
        self.tokenizer = tokenizer
        self.client.start_stream(callback=lambda result, error: self.q.put((result, error)))

    def send(self, model: str, inputs: list, request_id: str, params: dict) -> None:
        self.client.async_stream_infer(model, inputs, request_id=request_id, parameters=params or None,
                                       enable_empty_final_response=True)

    def collect(self, res: Result, timeout: float = 120.0, until_responses: int | None = None) -> Result:
        """Read responses until FINAL (or until ``until_responses`` data responses arrived)."""
        deadline = time.monotonic() + timeout
        while True:
            if until_responses is not None and res.responses >= until_responses:
                return res
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"request {res.request_id}: no FINAL after {timeout}s ({res})")
            try:
                result, error = self.q.get(timeout=left)
            except queue.Empty:
                continue
            if error is not None:
                res.error = str(error)
                return res
            self._absorb(res, result)
            if res.finals:
                return res

    def _absorb(self, res: Result, result) -> None:
        resp = result.get_response()
        final = resp.parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            res.finals += 1
        if not resp.outputs:
            return
        res.responses += 1
        c = res.choices.setdefault(_scalar(result, "index") or 0, Choice())
        ids = result.as_numpy("output_ids")
        c.ids += [] if ids is None else [int(t) for t in ids.reshape(-1)]
        text = _scalar(result, "text_output")
        if text is None and self.tokenizer is not None and result.as_numpy("window_ids") is not None:
            window = [int(t) for t in result.as_numpy("window_ids").reshape(-1)]
            text = decode_delta(self.tokenizer, window, _scalar(result, "num_sent"),
                                final=bool(_scalar(result, "finish_reason")),
                                max_chars=_scalar(result, "max_chars"))
        c.text += text or ""
        lp = _scalar(result, "logprobs")
        if lp:
            c.logprobs += json.loads(lp)
        fr = _scalar(result, "finish_reason")
        if fr:
            c.finish_reason = fr
            c.final = {k: _scalar(result, k) for k in ("prompt_tokens", "completion_tokens", "cached_tokens")}
            m = _scalar(result, "metrics")
            c.final["metrics"] = json.loads(m) if m else None

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def generate(server, model: str = "llm", *, text=None, messages=None, input_ids=None, request_id=None,
             tokenizer=None, timeout: float = 120.0, **params) -> Result:
    rid = request_id or uuid.uuid4().hex
    s = Stream(server, tokenizer)
    try:
        s.send(model, make_inputs(text=text, messages=messages, input_ids=input_ids), rid, params)
        return s.collect(Result(rid), timeout=timeout)
    finally:
        s.close()


def abort(server, target: str) -> Result:
    """Explicit abort control request to the engine model; returns its (single) answer."""
    return generate(server, "engine", request_id=f"abort-{target}", abort_request_id=target)


# -- metrics ----------------------------------------------------------------------------------
def scrape(server) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(name, ((label, value), ...)): value} for our llm_ metrics."""
    return labelled(scrape_text(server.metrics_url), prefix="llm_", drop=("model", "version"))


def metric(snapshot: dict, name: str, **labels) -> float:
    return snapshot.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_metric(server, pred, timeout: float = 30.0, interval: float = 0.05) -> tuple[dict, float]:
    """Scrape until ``pred(snapshot)`` holds; returns (snapshot, seconds waited). Raises on timeout."""
    t0 = time.monotonic()
    while True:
        snap = scrape(server)
        if pred(snap):
            return snap, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"metrics condition not met within {timeout}s: "
                                 f"{ {k[0]: v for k, v in snap.items() if 'bucket' not in k[0]} }")
        time.sleep(interval)


def start_serve(args: list[str], *, timeout: float = 180, env: dict | None = None):
    """``python -m triton_llm.cli serve ARGS`` from the project root, its output collected line by line;
    returns (process, lines) once it printed "Ctrl-C to stop" (fails the test with the output if
    it exits or takes longer than ``timeout``). The caller stops it."""
    import os
    import subprocess
    import sys
    import threading

    import pytest

    from tests.conftest import ROOT

    proc = subprocess.Popen([sys.executable, "-m", "triton_llm.cli", "serve", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = time.monotonic() + timeout
    while not any("Ctrl-C to stop" in line for line in lines):
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            pytest.fail(f"serve did not come up:\n{''.join(lines)}")
        time.sleep(0.2)
    return proc, lines


def reap_serve(proc, workdir) -> None:
    """After a ``start_serve`` test: kill the process if it still runs, then assert nothing that
    ran in ``workdir`` is left behind."""
    import subprocess

    if proc.poll() is None:
        proc.kill()
        proc.wait()
    left = subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left behind: {left}"
