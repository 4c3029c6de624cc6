"""Grammar compilation for one tokenizer, off the engine's path: ``Grammars``.

Compiling against a vocabulary costs milliseconds to seconds (xgrammar precomputes which tokens
each grammar position allows), so it never runs on the engine thread or Triton's execute thread:

    Intake (execute thread) ── prepare_async(params) ──► Future   (caps / bias errors raise here)
        cache hit ─────────────────────────────────────► done at once
        miss ── CompileWorker (worker.py: own thread, GIL released, budget) ─┐
                                                                            ▼
        params.structured = spec.with_grammar(grammar) ◄── result ── ByteLRU (cache.py, bytes)
        ──► EngineLoop.submit / LLMEngine.add_request: prepare(params) returns the attached grammar

A request waits for its grammar before it reaches the engine (not in the running batch) while
other requests keep stepping; no lock is held during a compile. Past ``budget_s`` (queue wait
included) the request is a 400 naming its field. ``prepare`` is the blocking form, for callers
that may wait (the offline API); on an attached or cached grammar it returns at once. The
tokenizer's vocabulary (``xgrammar.TokenizerInfo``) is read once, on the worker, on first use.
"""
from __future__ import annotations

import json
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from backend.errors import EngineError, invalid_request
from backend.structured.cache import ByteLRU
from backend.structured.spec import StructuredSpec
from backend.structured.worker import BudgetExceeded, CompileWorker, resolve

if TYPE_CHECKING:
    from backend.structured.matcher import GrammarState

DEFAULT_BUDGET_S = 5.0                   # wall clock from submit to compiled, queue wait included
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024  # compiled grammars kept, by their memory_size_bytes


class Grammar:
    """A compiled grammar; every choice of a request gets its own matcher from it."""

    def __init__(self, compiled: Any, spec: StructuredSpec, owner: Any = None, nbytes: int = 0):
        self.compiled = compiled
        self.spec = spec
        self.owner = owner               # the Grammars (vocabulary) it was compiled for
        self.nbytes = nbytes

    def matcher(self) -> GrammarState:
        from backend.structured.matcher import GrammarState
        return GrammarState(self)


class Grammars:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], *,
                 budget_s: float = DEFAULT_BUDGET_S, cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache = ByteLRU(cache_bytes)
        self.worker = CompileWorker(budget_s)
        self._compiler = None            # touched only on the worker thread
        self.hits = 0
        self.misses = 0

    def check(self, params) -> StructuredSpec | None:
        """The cheap checks of ``params`` (SamplingParams) against this vocabulary; the spec to
        compile, or None if unconstrained. Raises EngineError invalid_request naming the field."""
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
        return spec

    def prepare_async(self, params) -> Future:
        """A Future of the request's Grammar (None if unconstrained), done at once on a cache hit;
        on success ``params.structured`` carries the grammar. Fails with EngineError."""
        spec = self.check(params)
        out: Future = Future()
        ready = self._ready(spec) if spec is not None else None
        if spec is None or ready is not None:
            out.set_result(ready)
            return out
        self.misses += 1

        def done(fut: Future) -> None:
            try:
                grammar = fut.result()
            except BudgetExceeded as exc:
                why = ("took longer than that to compile; simplify it (shorter bounded repetitions) "
                       "or retry: a finished compile is cached") if exc.started else \
                      "waited for other grammars to compile; retry"
                resolve(out, error=invalid_request(spec.param, f"{spec.param} was not compiled within "
                                                               f"the {exc.budget_s:g} s budget: it {why}"))
                return
            except BaseException as exc:              # noqa: BLE001 - EngineError from _compile_now
                resolve(out, error=exc)
                return
            params.structured = spec.with_grammar(grammar)
            resolve(out, grammar)

        self.worker.submit(spec.key, lambda: self._compile_now(spec)).add_done_callback(done)
        return out

    def prepare(self, params) -> Grammar | None:
        """The blocking form of :meth:`prepare_async` (the offline API, tests); at once for a
        request that asks for no constraint (SamplingParams.constrained)."""
        if not getattr(params, "constrained", True):
            return None
        if self.worker.on_worker_thread():          # a caller running on the worker itself
            spec = self.check(params)
            return None if spec is None else (self._ready(spec) or self._compile_now(spec))
        return self.prepare_async(params).result()

    def compile(self, spec: StructuredSpec) -> Grammar:
        from backend.engine.admission import SamplingParams
        return self.prepare(SamplingParams(structured=spec))

    def _ready(self, spec: StructuredSpec) -> Grammar | None:
        attached = getattr(spec, "compiled_grammar", None)
        if attached is not None and attached.owner is self:
            return attached
        hit = self.cache.get(spec.key)
        if hit is not None:
            self.hits += 1
        return hit

    def _compile_now(self, spec: StructuredSpec) -> Grammar:
        """On the worker thread: compile and cache ``spec``; EngineError naming its field."""
        try:
            compiled = _compile(self._get_compiler(spec), spec)
        except EngineError:
            raise
        except Exception as exc:             # xgrammar: RuntimeError / ValueError with the reason
            raise invalid_request(spec.param, f"{spec.param} cannot be used as an output "
                                              f"constraint: {_first_line(exc)}") from None
        nbytes = int(getattr(compiled, "memory_size_bytes", 0)) + len(spec.value)
        grammar = Grammar(compiled, spec, self, nbytes)
        self.cache.put(spec.key, grammar, nbytes)
        return grammar

    def _get_compiler(self, spec: StructuredSpec):
        if self._compiler is None:
            if self.tokenizer is None:
                raise invalid_request(spec.param, "structured outputs need the model's tokenizer")
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
