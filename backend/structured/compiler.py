"""Grammar compilation for one tokenizer, cached: ``Grammars.prepare(params)`` -> a ``Grammar``.

Compiling a JSON schema against a vocabulary costs milliseconds to seconds (xgrammar precomputes
which tokens each grammar position allows), so each (kind, text) is compiled once and kept in an
LRU of ``capacity`` entries. ``prepare`` runs on the caller's thread (EngineLoop.submit, so a bad
schema is a 400 before the request is queued) and again on the engine thread (a cache hit); a lock
makes the cache safe for both. The tokenizer's vocabulary (``xgrammar.TokenizerInfo``) is read
once, on the first structured request.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from backend.errors import EngineError, invalid_request
from backend.structured.spec import StructuredSpec


class Grammar:
    """A compiled grammar; every choice of a request gets its own matcher from it."""

    def __init__(self, compiled: Any, spec: StructuredSpec):
        self.compiled = compiled
        self.spec = spec

    def matcher(self):
        from backend.structured.matcher import GrammarState
        return GrammarState(self)


class Grammars:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], *, capacity: int = 128):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.capacity = capacity
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = None
        self.hits = 0
        self.misses = 0

    def prepare(self, params) -> Grammar | None:
        """Validate the structured-output parts of ``params`` (SamplingParams) against this
        vocabulary and return the compiled grammar (None if unconstrained). Raises EngineError
        invalid_request naming the field."""
        bias = getattr(params, "logit_bias", None)
        if bias:
            bad = [t for t in bias if t >= self.vocab_size]
            if bad:
                raise invalid_request("logit_bias", f"logit_bias token id {bad[0]} is outside the "
                                                    f"vocabulary [0, {self.vocab_size})")
        spec = getattr(params, "structured", None)
        if spec is None:
            return None
        if params.min_tokens:
            raise invalid_request("min_tokens", "min_tokens cannot be combined with a structured output: "
                                                "the grammar decides when the output may end")
        return self.compile(spec)

    def compile(self, spec: StructuredSpec) -> Grammar:
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                self.hits += 1
                return hit
            self.misses += 1
            compiler = self._get_compiler()
            try:
                compiled = _compile(compiler, spec)
            except EngineError:
                raise
            except Exception as exc:         # xgrammar: RuntimeError / ValueError with the reason
                raise invalid_request(spec.param, f"{spec.param} cannot be used as an output "
                                                  f"constraint: {_first_line(exc)}") from None
            grammar = Grammar(compiled, spec)
            self._cache[spec.key] = grammar
            if len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
            return grammar

    def _get_compiler(self):
        if self._compiler is None:
            if self.tokenizer is None:
                raise invalid_request("response_format", "structured outputs need the model's tokenizer")
            import xgrammar as xgr
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


# xgrammar 0.2.9 writes a length-bounded JSON string (maxLength / minLength) as characters of
# [^"\\\r\n], which lets raw control characters (U+0000..U+001F) through: invalid JSON that
# json.loads refuses (random weights emit them). The unbounded string rule already excludes them,
# so the bounded one is patched to match before compiling.
_BOUNDED_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_CHARS = '[^\\0-\\x1f\\"\\\\\\r\\n]'


def _json_safe(grammar):
    import xgrammar as xgr
    ebnf = str(grammar)
    return xgr.Grammar.from_ebnf(ebnf.replace(_BOUNDED_CHARS, _JSON_CHARS)) if _BOUNDED_CHARS in ebnf else grammar


def _compile(compiler, spec: StructuredSpec):
    import xgrammar as xgr
    # any_whitespace=False: compact JSON (", " and ": "). With free whitespace a model (random
    # weights certainly) may emit spaces forever and never reach the end of the object.
    if spec.kind == "json_schema":
        grammar = xgr.Grammar.from_json_schema(spec.value, any_whitespace=False, strict_mode=True)
        return compiler.compile_grammar(_json_safe(grammar))
    if spec.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.value)
    if spec.kind == "choice":
        options = json.loads(spec.value)
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(o) for o in options))
    if spec.kind == "grammar":
        return compiler.compile_grammar(spec.value)
    if spec.kind == "tool_calls":
        from backend.structured.tool_spec import structural_tag
        return compiler.compile_grammar(_json_safe(xgr.Grammar.from_structural_tag(structural_tag(spec.value))))
    raise invalid_request(spec.param, f"unknown structured output kind {spec.kind!r}")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
