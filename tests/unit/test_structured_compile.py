"""Grammar compiles off the engine's path (backend/structured: caps.py, cache.py, worker.py,
compiler.py): the caps are 400s naming the field, the cache is bounded by bytes, a compile has a
wall-clock budget (queue wait included), and while the compile worker is busy the engine keeps
stepping other requests and cached grammars are served without waiting for it."""
from __future__ import annotations

import json
import queue
import threading

import pytest

from backend.engine.engine_loop import EngineLoop
from backend.engine.llm_engine import LLMEngine
from backend.config import EngineConfig
from backend.errors import EngineError
from backend.engine.admission import InvalidSamplingParam, SamplingParams
from backend.structured.cache import ByteLRU
from backend.structured.caps import MAX_NESTING, MAX_REPEAT, MAX_UNROLLED, check_spec
from backend.structured.spec import StructuredSpec, spec_from_params
from backend.structured.worker import BudgetExceeded, CompileWorker
from tests.conftest import model_dir

pytest.importorskip("xgrammar")


# -- caps -------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, why", [
    ("guided_regex", "(.{0,200}x){20}", f"at most {MAX_REPEAT} per repetition"),
    ("guided_regex", "a{5000,}", f"at most {MAX_REPEAT} per repetition"),
    ("guided_regex", "((a{0,20}){20}){20}", f"more than {MAX_UNROLLED} copies"),
    ("guided_regex", "(x.{0,100})" * 21, f"more than {MAX_UNROLLED} copies"),
    ("guided_regex", "(" * 40 + "a" + ")" * 40, f"deeper than {MAX_NESTING}"),
    ("guided_regex", "a" * 5000, "longer than 4096 characters"),
    ("guided_grammar", 'root ::= [a-z]{0,500}', f"at most {MAX_REPEAT} per repetition"),
    ("guided_json", json.dumps({"type": "object", "properties": {"a": {"type": "string",
                                                                       "pattern": ".{0,300}"}}}),
     f"at most {MAX_REPEAT} per repetition"),
    ("guided_json", '{"a":' * 40 + "1" + "}" * 40, f"deeper than {MAX_NESTING} levels"),
    ("guided_json", '{"a":' * 100_000 + "1" + "}" * 100_000, "nests too deeply"),   # json.loads RecursionError
    ("response_format", json.dumps({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "patternProperties": {"^x{0,999}$": {"type": "integer"}}}}}),
     f"at most {MAX_REPEAT} per repetition"),
])
def test_caps_are_400s_naming_the_field(field, value, why):
    with pytest.raises(InvalidSamplingParam) as e:
        spec_from_params({field: value})
    assert e.value.param == field and why in str(e.value)


@pytest.mark.parametrize("kind, value", [
    ("regex", r"[A-Z]{3}-\d{4}"), ("regex", "(.{0,100}x){20}"), ("regex", "a{100}((b{10}){19}){10}"),
    ("regex", r"\{500\}[{0,999}]"), ("regex", "(.*x)+" * 30), ("grammar", 'root ::= "{9999}" [a-z]{1,100}'),
])
def test_within_the_caps_is_accepted(kind, value):
    check_spec(kind, value, "guided_" + kind)


# -- byte-bounded cache -----------------------------------------------------------------------
def test_byte_lru_evicts_least_recent_by_bytes_and_skips_oversize():
    c = ByteLRU(100)
    assert c.put("a", 1, 40) and c.put("b", 2, 40)
    assert c.get("a") == 1                      # a is now the most recent
    assert c.put("c", 3, 40)                    # 120 > 100: b (least recent) goes
    assert ("b" in c, "a" in c, "c" in c, c.bytes) == (False, True, True, 80)
    assert not c.put("huge", 4, 101) and "huge" not in c and c.bytes == 80
    assert c.put("a", 5, 10) and c.bytes == 50 and c.get("a") == 5      # replaced, recharged


def test_grammar_cache_is_bounded_by_bytes_not_count(grammars):
    first = grammars.compile(StructuredSpec.regex("[a-z]{1,10}q"))
    assert first.nbytes > first.compiled.memory_size_bytes > 0
    grammars.cache.max_bytes = int(first.nbytes * 2.5)
    for i in range(1, 8):
        grammars.compile(StructuredSpec.regex(f"[a-z]{{1,{10 + i}}}q{i}"))
        assert grammars.cache.bytes <= grammars.cache.max_bytes
    assert 0 < len(grammars.cache) < 8 and StructuredSpec.regex("[a-z]{1,10}q").key not in grammars.cache


# -- the compile worker's budget --------------------------------------------------------------
def test_a_waiter_past_its_budget_fails_while_the_compile_still_runs():
    w = CompileWorker(budget_s=0.05)
    release, started = threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait(30)
        return "done"

    first = w.submit("slow", slow)
    assert started.wait(10)
    queued = w.submit("next", lambda: "never")
    with pytest.raises(BudgetExceeded) as e:
        first.result(10)
    assert e.value.started
    with pytest.raises(BudgetExceeded) as e:
        queued.result(10)
    assert not e.value.started                  # it waited behind the slow one
    release.set()
    late = w.submit("after", lambda: "ok")      # the skipped job never ran; the worker goes on
    assert late.result(10) == "ok" and w.skipped == 1 and w.compiled == 2
    w.close()


def test_waiters_of_one_key_share_one_compile():
    w = CompileWorker(budget_s=30)
    gate, calls = threading.Event(), []
    w.submit("block", lambda: gate.wait(30))
    a = w.submit("k", lambda: calls.append(1) or "g")
    b = w.submit("k", lambda: calls.append(2) or "other")
    gate.set()
    assert (a.result(10), b.result(10), calls) == ("g", "g", [1])
    w.close()


# -- Grammars: no lock, no engine wait --------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(str(model_dir("tiny")))


@pytest.fixture()
def grammars(tok):
    from backend.structured.compiler import Grammars
    vocab = json.loads((model_dir("tiny") / "config.json").read_text())["vocab_size"]
    g = Grammars(tok, vocab, [tok.convert_tokens_to_ids("<|im_end|>")], budget_s=0.3)
    yield g
    g.worker.close()


def _block_worker(grammars) -> threading.Event:
    """Occupy the compile worker until the returned event is set (a stand-in for a slow compile)."""
    gate, running = threading.Event(), threading.Event()
    grammars.worker.submit("test-block", lambda: running.set() or gate.wait(60))
    assert running.wait(10)
    return gate


def test_over_budget_is_a_400_naming_the_field_and_cached_grammars_do_not_wait(grammars):
    cached = SamplingParams(structured=StructuredSpec.regex("[ab]+"))
    grammars.prepare(cached)
    gate = _block_worker(grammars)
    try:
        assert grammars.prepare_async(SamplingParams(structured=StructuredSpec.regex("[ab]+"))).done()
        waiting = SamplingParams(structured=StructuredSpec("regex", "[cd]+", "guided_regex"))
        fut = grammars.prepare_async(waiting)
        assert not fut.done()
        with pytest.raises(EngineError) as e:
            fut.result(10)
        assert e.value.param == "guided_regex" and "budget" in str(e.value)
        assert getattr(waiting.structured, "compiled_grammar", None) is None
    finally:
        gate.set()
    ok = SamplingParams(structured=StructuredSpec.regex("[ef]+"))
    g = grammars.prepare_async(ok).result(10)
    assert ok.structured.compiled_grammar is g and grammars.prepare(ok) is g     # attached


def test_the_engine_keeps_stepping_while_a_grammar_compiles(grammars):
    """An unconstrained request runs to its end while the compile worker is held; the constrained
    one enters the engine only when its grammar is ready, and follows it."""
    engine = LLMEngine(model_dir("tiny"), EngineConfig(num_threads=1))
    engine.grammars.worker.close()
    engine.grammars = grammars                     # the fixture's worker, which the test holds
    loop = EngineLoop(engine)
    try:
        gate = _block_worker(grammars)
        grammars.worker.budget_s = 60
        params = SamplingParams(max_tokens=6, structured=StructuredSpec.regex("[xy]{6}"))
        compiled = grammars.prepare_async(params)
        free: queue.Queue = queue.Queue()
        loop.submit("free", [5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True), sink=free)
        tokens = []
        while True:
            d = free.get(timeout=60)
            tokens += d.new_token_ids
            if d.finished:
                break
        assert len(tokens) == 20 and not compiled.done() and loop.num_open == 0
        gate.set()
        compiled.result(30)
        out: queue.Queue = queue.Queue()
        loop.submit("constrained", [5, 6, 7], params, sink=out)
        text = []
        while True:
            d = out.get(timeout=60)
            text += d.new_token_ids
            if d.finished:
                break
        decoded = grammars.tokenizer.decode(text, skip_special_tokens=True)
        assert len(decoded) == 6 and set(decoded) <= {"x", "y"}, decoded
    finally:
        loop.shutdown(drain=False, timeout=10)
