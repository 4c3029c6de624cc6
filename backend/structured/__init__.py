"""Structured outputs: grammar-constrained decoding (xgrammar) and logit_bias.

    spec.py       StructuredSpec (what a request constrains its output to), request parsing
    tool_spec.py  OpenAI tools / tool_choice -> Hermes <tool_call> format and its grammar
    tool_prompt.py  tools and tool messages rendered for chat templates without tool support
    compiler.py   Grammars: compile once per (spec, tokenizer), LRU cache, request validation
    matcher.py    GrammarState: one choice's matcher, advanced with its accepted tokens
    logits.py     apply_constraints: logit_bias + the batch's token bitmask, before sampling
"""
from backend.structured.spec import StructuredSpec

__all__ = ["StructuredSpec"]
