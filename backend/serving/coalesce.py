"""Fewer sends for the same tokens: merge a choice's queued (or held) deltas.

Under load the engine produces deltas faster than one IPC send each can carry them; merging a
choice's backlog keeps every token and its order while sending (and postprocessing) once.
"""
from __future__ import annotations

from dataclasses import replace

from backend.outputs import StepDelta
from backend.serving.messages import DeltaArrived, Message


def merge_deltas(a: StepDelta, b: StepDelta) -> StepDelta | None:
    """One delta equivalent to sending ``a`` then ``b`` (same choice), or None if they must stay apart.

    b's window starts at most CONTEXT_TOKENS before the end of a's, and its first ``num_sent`` ids
    are already-sent context, so a's window followed by b's new ids is one window with a's
    ``num_sent``. A stop-string cut (``max_chars``) is relative to its own window: never merged.
    """
    if a.finished or a.max_chars >= 0 or b.max_chars >= 0 or a.error is not None or b.error is not None:
        return None
    return replace(b, new_token_ids=a.new_token_ids + b.new_token_ids,
                   window_ids=a.window_ids + b.window_ids[b.num_sent:], num_sent=a.num_sent,
                   logprobs=a.logprobs + b.logprobs)


def coalesce(batch: list[Message]) -> list[Message]:
    """The batch with each choice's consecutive deltas merged; other messages keep their place."""
    if len(batch) < 2:
        return batch
    out: list[Message] = []
    last: dict[tuple[int, int], int] = {}       # (request handle, choice) -> position in out
    for msg in batch:
        if not isinstance(msg, DeltaArrived):
            out.append(msg)
            continue
        key = (id(msg.handle), msg.delta.index)
        at = last.get(key)
        merged = None if at is None else merge_deltas(out[at].delta, msg.delta)
        if merged is None:
            last[key] = len(out)
            out.append(msg)
        else:
            out[at] = DeltaArrived(msg.handle, merged)
    return out
