"""The engine's response thread detokenizes (the ``llm`` ensemble has no postprocessing step per
token): the text is the postprocessing model's, byte for byte; only requested outputs are built;
ensemble steps are asked ``is_cancelled()`` only at the sweep interval; ``busy_stream_interval``
gathers tokens only while many requests are open.
"""
from __future__ import annotations

import random
from concurrent.futures import Future

import pytest

from backend import protocol as P
from backend.outputs import decode_delta, window_start
from backend.errors import ErrorKind
from backend.outputs import StepDelta, TokenLogprob
from backend.serving.engine_service import EngineService, Incoming
from backend.serving.postprocess import Postprocessor, RustDecode
from backend.serving.postprocess import logprobs_json
from tests.conftest import model_dir

ENSEMBLE_WANT = frozenset(t.name for t in P.TEXT_OUTPUTS if t.name != P.LOGPROBS) | {P.TEXT_LOGPROBS}


class Clock:
    t = 1000.0

    def __call__(self):
        return self.t


class Responder:
    def __init__(self):
        self.sent, self.checks = [], 0

    def send(self, outputs=None, *, error=None, final=False):
        self.sent.append((outputs, error, final))

    def is_cancelled(self):
        self.checks += 1
        return False

    def texts(self):
        return [o[P.TEXT_OUTPUT][0].decode() for o, _, _ in self.sent if o is not None]


class Loop:
    healthy = True

    def __init__(self):
        self.sinks = {}

    def submit(self, rid, ids, params, *, sink, **kw):
        self.sinks[rid] = sink

    def abort(self, rid, tenant=None):
        f = Future()
        f.set_result(None)
        return f


@pytest.fixture(scope="module")
def post():
    return Postprocessor(model_dir("tiny"))


def service(clock, post=None, **kw):
    return EngineService(Loop(), max_model_len=4096, clock=clock, start=False, detokenizer=post,
                         sweep_interval=0.1, cancel_check_interval=0.02, **kw)


def submit(svc, rid, want, **params):
    r = Responder()
    svc.submit(Incoming(rid, [1, 2, 3], {"max_tokens": 500, **params}, r, requested_outputs=want))
    return r


def step(svc, clock, dt=0.001):
    clock.t += dt
    assert svc.responses.step(0)


def engine_deltas(rid, ids, chunks):
    """The engine's deltas for ``ids`` sent in chunks (window, num_sent as outputs.make_deltas makes them)."""
    out, sent = [], 0
    for n in chunks:
        end = min(len(ids), sent + n)
        ws = window_start(sent)
        out.append(StepDelta(rid, 0, ids[sent:end], ids[ws:end], sent - ws, finished=end == len(ids),
                             finish_reason="length" if end == len(ids) else None,
                             logprobs=[TokenLogprob(t, -0.5, [(t, -0.5), (t + 1, -1.25)]) for t in ids[sent:end]]))
        sent = end
        if end == len(ids):
            break
    return out


def test_rust_decode_is_transformers_decode(post):
    assert isinstance(post.decoder, RustDecode)
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(post.tokenizer.vocab_size) for _ in range(rng.randint(0, 9))]
        for skip in (True, False):
            assert post.decoder.decode(ids, skip_special_tokens=skip) == \
                post.tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("seed", range(4))
def test_engine_text_is_the_postprocessing_text_byte_for_byte(post, seed):
    """Multi-byte characters split across tokens included: each response's text and logprobs equal
    what the postprocessing model makes of the same response (slow transformers decode)."""
    rng = random.Random(seed)
    text = "naïve café — 日本語 ok 🙂 " * 3
    ids = post.tokenizer.encode(text, add_special_tokens=False) + [rng.randrange(300) for _ in range(12)]
    clock = Clock()
    svc = service(clock, post)
    r = submit(svc, "a", ENSEMBLE_WANT)
    step(svc, clock)
    deltas = engine_deltas("a", ids, [rng.randint(1, 4) for _ in range(len(ids))])
    for d in deltas:
        svc.loop.sinks["a"](d)
        step(svc, clock)
    expected = [decode_delta(post.tokenizer, d.window_ids, d.num_sent, final=d.finished) for d in deltas]
    assert r.texts() == expected
    assert "".join(r.texts()) == post.tokenizer.decode(ids, skip_special_tokens=True,
                                                     clean_up_tokenization_spaces=False)
    for (o, _, _), d in zip(r.sent, deltas):
        assert o[P.TEXT_LOGPROBS][0].decode() == post.logprobs(logprobs_json(d))
        assert set(o) == ENSEMBLE_WANT                   # nothing unrequested was built


def test_token_clients_get_no_text_and_everything_else(post):
    clock = Clock()
    svc = service(clock, post)
    r = submit(svc, "t", frozenset({P.OUTPUT_IDS, P.FINISH_REASON}))
    everything = submit(svc, "e", None)
    step(svc, clock)
    for rid in ("t", "e"):
        svc.loop.sinks[rid](StepDelta(rid, 0, [5], [5], 0, finished=True, finish_reason="length"))
    step(svc, clock)
    assert set(r.sent[0][0]) == {P.OUTPUT_IDS, P.FINISH_REASON}
    assert set(everything.sent[0][0]) == {t.name for t in P.ENGINE_OUTPUTS}


def test_a_detokenizer_failure_is_one_internal_error_for_that_request():
    class Broken:
        def delta_text(self, d, skip):
            raise ValueError("boom")

    clock = Clock()
    svc = service(clock, Broken())
    r = submit(svc, "x", ENSEMBLE_WANT)
    step(svc, clock)
    svc.loop.sinks["x"](StepDelta("x", 0, [5], [5], 0))
    step(svc, clock)
    assert len(r.sent) == 1 and r.sent[0][0] is None and r.sent[0][2]
    assert r.sent[0][1].kind == ErrorKind.INTERNAL


def test_ensemble_steps_are_checked_for_cancel_once_a_second_only():
    clock = Clock()
    svc = service(clock)
    ens, direct = submit(svc, "e", ENSEMBLE_WANT), submit(svc, "d", None)
    step(svc, clock, 0)
    for i in range(30):                     # a token every 8 ms for 240 ms
        for rid in ("e", "d"):
            svc.loop.sinks[rid](StepDelta(rid, 0, [i], [i], 0))
        step(svc, clock, 0.008)
    assert (direct.checks, ens.checks) == (10, 0)
    for _ in range(100):                    # silent for 1 s: the sweep asks each at its own interval
        step(svc, clock, 0.01)
    assert direct.checks >= 10 + 8 and ens.checks == 1     # direct: every ~0.1 s; ensemble: once


def test_the_clients_one_pass_parse_equals_tritonclients_as_numpy():
    """client/triton_client.py reads a response's outputs once; same Chunk as InferResult.as_numpy."""
    import numpy as np
    from tritonclient.grpc import InferResult, service_pb2

    from client.wire import parse_response

    resp = service_pb2.ModelInferResponse(model_name="llm", id="r")
    values = {P.TEXT_OUTPUT: "héllo 🙂", P.FINISH_REASON: "stop", P.INDEX: [1], P.PROMPT_TOKENS: [7],
              P.COMPLETION_TOKENS: [2], P.CACHED_TOKENS: [0], P.OUTPUT_IDS: [5, 6],
              P.LOGPROBS: '[{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}]',
              P.METRICS: '{"ttft": 0.1}'}
    for name, v in values.items():
        out = resp.outputs.add(name=name)
        if isinstance(v, str):
            out.datatype, out.shape[:] = "BYTES", [1]
            b = v.encode()
            resp.raw_output_contents.append(len(b).to_bytes(4, "little") + b)     # Triton's BYTES layout
        else:
            out.datatype, out.shape[:] = "INT32", [len(v)]
            resp.raw_output_contents.append(np.array(v, dtype=np.int32).tobytes())

    class Slow:                              # tritonclient's own as_numpy, no get_response
        def __init__(self, r):
            self.r = InferResult(r)

        def as_numpy(self, name):
            return self.r.as_numpy(name)

    fast = parse_response(InferResult(resp))
    assert fast == parse_response(Slow(resp))
    assert fast.text == "héllo 🙂" and fast.token_ids == [5, 6] and fast.index == 1 and fast.window_ids is None


@pytest.mark.parametrize("seed", range(4))
def test_gathered_responses_are_the_same_text_byte_for_byte(post, seed):
    """busy_stream_interval holds and merges deltas at random step spacing: each response's text
    and logprobs are what the postprocessing model makes of that (merged) response, and the stream's
    text is the whole decode, multi-byte characters split across tokens included."""
    rng = random.Random(seed)
    text = "naïve café — 日本語 ok 🙂 " * 3
    ids = post.tokenizer.encode(text, add_special_tokens=False) + [rng.randrange(300) for _ in range(12)]
    clock = Clock()
    svc = service(clock, post, busy_stream_interval=0.05)
    svc.responses.hold.busy_streams = 1
    r = submit(svc, "a", ENSEMBLE_WANT)
    step(svc, clock)
    for d in engine_deltas("a", ids, [rng.randint(1, 3) for _ in range(len(ids))]):
        svc.loop.sinks["a"](d)
        step(svc, clock, rng.choice([0.004, 0.02, 0.03, 0.06]))
    sent = [o for o, _, _ in r.sent]
    assert len(sent) < len(engine_deltas("a", ids, [1] * len(ids)))      # something was gathered
    assert "".join(r.texts()) == post.tokenizer.decode(ids, skip_special_tokens=True,
                                                       clean_up_tokenization_spaces=False)
    at = 0
    for o in sent:                          # each response = the postprocessing of its own ids
        n = len(o[P.OUTPUT_IDS])
        window = ids[window_start(at):at + n]
        assert o[P.TEXT_OUTPUT][0].decode() == decode_delta(post.tokenizer, window, at - window_start(at),
                                                           final=at + n == len(ids))
        lps = [TokenLogprob(t, -0.5, [(t, -0.5), (t + 1, -1.25)]) for t in ids[at:at + n]]
        assert o[P.TEXT_LOGPROBS][0].decode() == post.logprobs(logprobs_json(StepDelta("a", 0, [], [], 0, logprobs=lps)))
        at += n
    assert at == len(ids) and r.sent[-1][2] and sum(f for _, _, f in r.sent) == 1
