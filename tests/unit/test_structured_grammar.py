"""The grammar layer (backend/structured) against xgrammar's own matcher, on the project tokenizer:
specs from request fields, the compile cache, the batch bitmask (plain rows, draft rows with
rollback), logit_bias, and termination."""
from __future__ import annotations

import json

import pytest
import torch

from backend.errors import EngineError
from backend.engine.admission import InvalidSamplingParam, SamplingParams
from backend.structured.compiler import Grammars
from backend.structured.logits import apply_constraints, fill_bitmask
from backend.structured.spec import StructuredSpec, parse_logit_bias, spec_from_params
from tests.conftest import model_dir

xgr = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 4},
                                           "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(str(model_dir("tiny")))


@pytest.fixture(scope="module")
def vocab(tok):
    return json.loads((model_dir("tiny") / "config.json").read_text())["vocab_size"]


@pytest.fixture()
def grammars(tok, vocab):
    return Grammars(tok, vocab, [tok.convert_tokens_to_ids("<|im_end|>")])


class _Seq:
    """The part of a Sequence the grammar layer reads."""

    def __init__(self, params: SamplingParams, grammar=None):
        self.params = params
        self.grammar = grammar.matcher() if grammar is not None else None
        self.finish_reason = None
        self.error = None
        self.cut_last_token = False


class _View:
    def __init__(self, seq, extra):
        self.seq, self.extra = seq, extra


def _reference_mask(compiled, tokens: list[int], vocab: int) -> torch.Tensor:
    m = xgr.GrammarMatcher(compiled)
    for t in tokens:
        assert m.accept_token(t)
    bm = xgr.allocate_token_bitmask(1, vocab)
    m.fill_next_token_bitmask(bm, 0)
    return bm[0]


def _greedy_tokens(compiled, vocab: int, n: int, seed: int) -> list[int]:
    """A path through the grammar: random logits, masked, argmax."""
    m, g, out = xgr.GrammarMatcher(compiled), torch.Generator().manual_seed(seed), []
    bm = xgr.allocate_token_bitmask(1, vocab)
    for _ in range(n):
        m.fill_next_token_bitmask(bm, 0)
        x = torch.randn(1, vocab, generator=g)
        xgr.apply_token_bitmask_inplace(x, bm)
        t = int(x.argmax())
        assert m.accept_token(t)
        out.append(t)
        if m.is_terminated():
            break
    return out


def test_specs_from_request_fields():
    s = spec_from_params({"response_format": json.dumps({"type": "json_schema",
                                                         "json_schema": {"name": "x", "schema": SCHEMA}})})
    assert s.kind == "json_schema" and json.loads(s.value) == SCHEMA and s.param == "response_format"
    assert spec_from_params({"response_format": {"type": "json_object"}}).kind == "json_object"
    assert spec_from_params({"response_format": {"type": "text"}}) is None
    assert spec_from_params({"guided_choice": '["x", "y"]'}).value == '["x", "y"]'
    assert spec_from_params({"guided_regex": "[a-z]+"}).kind == "regex"
    assert spec_from_params({"tools": [{"type": "function", "function": {"name": "f"}}]}) is None   # auto
    t = spec_from_params({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"})
    assert t.kind == "tool_calls" and json.loads(t.value)["tools"][0]["name"] == "f"
    with pytest.raises(InvalidSamplingParam) as e:
        spec_from_params({"guided_regex": "a", "guided_choice": ["a"]})
    assert e.value.param == "guided_choice"
    with pytest.raises(InvalidSamplingParam) as e:
        spec_from_params({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
    assert e.value.param == "response_format"
    with pytest.raises(InvalidSamplingParam) as e:
        spec_from_params({"tools": [{"type": "function", "function": {"name": "f"}}],
                          "tool_choice": {"type": "function", "function": {"name": "g"}}})
    assert e.value.param == "tool_choice"


def test_logit_bias_validation():
    assert parse_logit_bias({"5": 10, 7: -100}) == {5: 10.0, 7: -100.0}
    for bad in ({"5": 101}, {"x": 1}, {"-1": 1}, {"5": float("nan")}, {"5": True}, [1]):
        with pytest.raises(InvalidSamplingParam) as e:
            parse_logit_bias(bad)
        assert e.value.param == "logit_bias"
    assert SamplingParams(logit_bias={"3": 1}).logit_bias == {3: 1.0}


def test_compile_errors_and_vocab_checks_are_invalid_request(grammars, vocab):
    with pytest.raises(EngineError) as e:
        grammars.prepare(SamplingParams(structured=StructuredSpec.regex("(unclosed")))
    assert e.value.param == "guided_regex"
    with pytest.raises(EngineError) as e:
        grammars.prepare(SamplingParams(structured=StructuredSpec.grammar("root ::= undefined_rule")))
    assert e.value.param == "guided_grammar"
    with pytest.raises(EngineError) as e:
        grammars.prepare(SamplingParams(logit_bias={vocab: 1.0}))
    assert e.value.param == "logit_bias"
    with pytest.raises(EngineError) as e:
        grammars.prepare(SamplingParams(min_tokens=2, structured=StructuredSpec.json(SCHEMA)))
    assert e.value.param == "min_tokens"


def test_cache_hit_returns_the_same_grammar(grammars):
    a = grammars.compile(StructuredSpec.json(SCHEMA))
    b = grammars.compile(StructuredSpec("json_schema", json.dumps(SCHEMA), "response_format"))
    assert a is b and (grammars.hits, grammars.misses) == (1, 1)
    assert grammars.cache.bytes == a.nbytes > a.compiled.memory_size_bytes
    grammars.cache.max_bytes = a.nbytes        # room for one of them: the next compile evicts it
    x = grammars.compile(StructuredSpec.regex("x+"))
    assert StructuredSpec.json(SCHEMA).key not in grammars.cache and grammars.cache.bytes == x.nbytes
    assert grammars.compile(StructuredSpec.json(SCHEMA)) is not a and grammars.misses == 3   # evicted


def test_batch_bitmask_equals_xgrammar_matcher_and_leaves_others_alone(grammars, vocab):
    g1 = grammars.compile(StructuredSpec.json(SCHEMA))
    g2 = grammars.compile(StructuredSpec.regex(r"\d{2}[a-c]"))
    path = _greedy_tokens(g1.compiled, vocab, 6, seed=3)
    s1, s2, free = _Seq(SamplingParams(), g1), _Seq(SamplingParams(), g2), _Seq(SamplingParams())
    for t in path:
        s1.grammar.advance(s1, t)
    rows = [free, s1, s2]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    out = apply_constraints(logits.clone(), rows)
    assert torch.equal(out[0], logits[0])                          # unconstrained row: untouched
    for i, (g, toks) in ((1, (g1, path)), (2, (g2, []))):
        ref = _reference_mask(g.compiled, toks, vocab)
        allowed = torch.tensor([(int(ref[t // 32]) >> (t % 32)) & 1 for t in range(vocab)], dtype=torch.bool)
        assert torch.equal(torch.isfinite(out[i]), allowed)
        assert torch.equal(out[i][allowed], logits[i][allowed])
    again = fill_bitmask([s1], [0], vocab)                           # filling did not move the matcher
    assert torch.equal(again[0], _reference_mask(g1.compiled, path, vocab))


def test_draft_rows_match_the_matcher_after_each_prefix_and_roll_back(grammars, vocab):
    g = grammars.compile(StructuredSpec.json(SCHEMA))
    path = _greedy_tokens(g.compiled, vocab, 12, seed=5)
    seq = _Seq(SamplingParams(), g)
    for t in path[:2]:
        seq.grammar.advance(seq, t)
    drafts = path[2:6]
    bad = drafts[:2] + [0] + drafts[3:]          # token 0 is refused at position 2
    for run in (drafts, bad):
        rows = [_View(seq, run[:j]) for j in range(len(run) + 1)]
        bm = fill_bitmask(rows, list(range(len(rows))), vocab)
        for j in range(len(rows)):
            valid = min(j, 2) if run is bad else j
            assert torch.equal(bm[j], _reference_mask(g.compiled, path[:2] + run[:valid], vocab)), (run is bad, j)
    ref_now = _reference_mask(g.compiled, path[:2], vocab)       # rolled back: state unchanged
    bm = fill_bitmask([seq], [0], vocab)
    assert torch.equal(bm[0], ref_now)


def test_logit_bias_adds_to_the_row():
    seq = _Seq(SamplingParams(logit_bias={1: 5.0, 3: -100.0}))
    logits = torch.zeros(2, 8)
    out = apply_constraints(logits, [_Seq(SamplingParams()), seq])
    assert out[0].tolist() == [0.0] * 8
    assert out[1].tolist() == [0, 5, 0, -100, 0, 0, 0, 0]


def test_grammar_end_finishes_with_stop(grammars, vocab):
    g = grammars.compile(StructuredSpec.choice(["yes", "no"]))
    seq = _Seq(SamplingParams(), g)
    path = _greedy_tokens(g.compiled, vocab, 10, seed=0)
    for t in path[:-1]:
        seq.grammar.advance(seq, t)
        assert seq.finish_reason is None
    seq.grammar.advance(seq, path[-1])
    assert seq.finish_reason == "stop" and seq.grammar.terminated
    seq2 = _Seq(SamplingParams(), g)
    seq2.grammar.advance(seq2, 0)                 # refused: the choice ends with an internal error
    assert seq2.finish_reason == "error" and seq2.error.kind.value == "internal"


def test_bounded_strings_refuse_raw_control_characters(grammars):
    """xgrammar 0.2.9 lets U+0000..U+001F into maxLength strings (invalid JSON); compiler.py
    patches the rule, so only escaped forms are possible."""
    g = grammars.compile(StructuredSpec.json(SCHEMA))
    assert not xgr.GrammarMatcher(g.compiled).accept_string('{"a": "\x0f')
    assert xgr.GrammarMatcher(g.compiled).accept_string('{"a": "ok", "b": true}')
    unpatched = xgr.GrammarCompiler(g.compiled.tokenizer_info)
    raw = unpatched.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    assert xgr.GrammarMatcher(raw).accept_string('{"a": "\x0f')      # the upstream behaviour it fixes
