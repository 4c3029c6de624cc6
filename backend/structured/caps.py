"""Caps on what a structured-output constraint may ask of the grammar compiler, checked in linear
time when the request is parsed (a 400 naming the field, before anything compiles).

xgrammar's compile time grows with the number of grammar positions whose allowed-token set must be
precomputed over the whole vocabulary. A bounded repetition ``x{m,n}`` is unrolled into n copies
of ``x``, so a 10-character regex can ask for thousands of positions: on SmolLM2's 49k vocabulary
``.{0,100}`` takes about 2.5 s and ``.{0,200}`` over 10 s, while unbounded ``*`` / ``+`` loops
cost nothing extra. So, per expression:

    MAX_CHARS[kind]        the text itself
    MAX_REPEAT             the bound of one quantifier (n of {m,n}, m of {m,} and {m})
    MAX_UNROLLED           copies after unrolling: bounds multiply along nested groups and add
                           up side by side, (a{0,50}b{10}){20} = (50 + 10) * 20 = 1200
    MAX_NESTING            group / bracket nesting depth (regex, EBNF, schema JSON)

A JSON schema's ``pattern`` (and ``patternProperties`` keys) are regexes and get the same checks;
its ``maxLength`` / ``maxItems`` are compiled without unrolling and need no cap. Repetitions
reached through EBNF rule references are not multiplied here: the compile budget
(compiler.py) bounds what the caps let through.
"""
from __future__ import annotations

import json
import re
from typing import Any

from backend.errors import InvalidSamplingParam

KIB = 1024
MAX_CHARS = {"regex": 4 * KIB, "json_schema": 64 * KIB, "grammar": 64 * KIB, "choice": 64 * KIB,
             "tool_calls": 128 * KIB, "json_object": 0}
MAX_REPEAT = 100
MAX_UNROLLED = 2000
MAX_NESTING = 32

_QUANT = re.compile(r"\{(\d{1,9})(,(\d{0,9}))?\}")


def check_spec(kind: str, value: str, param: str) -> None:
    """Raise InvalidSamplingParam naming ``param`` when ``value`` (a spec's text) is over a cap."""
    limit = MAX_CHARS.get(kind, 0)
    if len(value) > limit:
        raise InvalidSamplingParam(param, f"{param} is longer than {limit} characters")
    if kind == "regex":
        check_repetitions(value, param, ebnf=False)
    elif kind == "grammar":
        check_repetitions(value, param, ebnf=True)
    elif kind in ("json_schema", "tool_calls"):
        check_schema_json(value, param)


def check_repetitions(text: str, param: str, *, ebnf: bool) -> None:
    """One pass over a regex (or xgrammar EBNF: quoted strings skipped) checking quantifier bounds,
    the copies they unroll into and the nesting depth."""
    stack = [0]              # per open group: the unrolled copies of the repetitions inside it
    last, added = 1, 0       # the atom a quantifier would apply to: its copies, and what it added
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i, last, added = i + 2, 1, 0
        elif ebnf and c in "\"'":
            i, last, added = _skip_string(text, i, param), 1, 0
        elif c == "[":
            i, last, added = _skip_class(text, i, param), 1, 0
        elif c == "(":
            stack.append(0)
            if len(stack) > MAX_NESTING + 1:
                raise InvalidSamplingParam(param, f"{param} nests groups deeper than {MAX_NESTING}")
            i += 1
        elif c == ")":
            inner = stack.pop() if len(stack) > 1 else 0
            stack[-1] += inner
            _check_unrolled(stack[-1], param)
            i, last, added = i + 1, max(1, inner), inner
        elif c == "{" and (m := _QUANT.match(text, i)) is not None:
            bound = max(int(m.group(1)), int(m.group(3) or 0))
            if bound > MAX_REPEAT:
                raise InvalidSamplingParam(param, f"{param} repeats {bound} times in {m.group(0)}; at "
                                                  f"most {MAX_REPEAT} per repetition (use * or + for "
                                                  "unbounded runs)")
            stack[-1] += last * bound - added
            _check_unrolled(stack[-1], param)
            i, last, added = m.end(), 1, 0
        else:
            if c not in "*+?":
                last, added = 1, 0
            i += 1


def _check_unrolled(copies: int, param: str) -> None:
    if copies > MAX_UNROLLED:
        raise InvalidSamplingParam(param, f"{param} unrolls its bounded repetitions into more than "
                                          f"{MAX_UNROLLED} copies (nested bounds multiply)")


def _skip_class(text: str, i: int, param: str) -> int:
    """The index after the character class opening at ``text[i] == '['``."""
    j = i + 1
    if j < len(text) and text[j] == "^":
        j += 1
    if j < len(text) and text[j] == "]":      # a leading ']' is a literal
        j += 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == "]":
            return j + 1
        j += 1
    raise InvalidSamplingParam(param, f"{param} has an unclosed character class")


def _skip_string(text: str, i: int, param: str) -> int:
    quote, j = text[i], i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == quote:
            return j + 1
        j += 1
    raise InvalidSamplingParam(param, f"{param} has an unclosed string literal")


def check_schema_json(value: str, param: str) -> None:
    """Nesting depth of a schema (or tool list) and the regexes inside it, without recursion."""
    try:
        doc = json.loads(value)
    except RecursionError:
        raise InvalidSamplingParam(param, f"{param} nests deeper than {MAX_NESTING} levels") from None
    except ValueError as exc:
        raise InvalidSamplingParam(param, f"{param} is not valid JSON: {exc}") from None
    todo: list[tuple[Any, int]] = [(doc, 0)]
    while todo:
        node, depth = todo.pop()
        if depth > MAX_NESTING:
            raise InvalidSamplingParam(param, f"{param} nests deeper than {MAX_NESTING} levels")
        if isinstance(node, dict):
            for key, child in node.items():
                if key == "pattern" and isinstance(child, str):
                    check_repetitions(child, param, ebnf=False)
                if key == "patternProperties" and isinstance(child, dict):
                    for rx in child:
                        check_repetitions(rx, param, ebnf=False)
                todo.append((child, depth + 1))
        elif isinstance(node, list):
            todo.extend((child, depth + 1) for child in node)
