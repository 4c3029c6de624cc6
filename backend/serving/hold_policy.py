"""Fewer sends for the same tokens: merging a choice's deltas, and how long a streamed choice's
mid-stream tokens may wait to be gathered into one response.

Under load the engine produces deltas faster than one IPC send each can carry them: ``coalesce``
merges a choice's queued backlog (``merge_deltas``: every token, in order), so it is sent (and
postprocessed) once.

With a hold interval (``stream_interval``, or ``busy_stream_interval`` while at least
``busy_streams`` requests are open, scaled by how many are) a choice's mid-stream delta that comes
less than the interval after the choice's last send is held and merged with the next ones
(``merge_deltas``: the same tokens and text), so one response (one ``send`` IPC, one
ensemble hop, one gRPC message, one SSE chunk) carries several steps' tokens. Each choice has its
own clock, and a held token waits at most its choice's interval: the first delta that comes an
interval after the last send takes it along (sends stay on step boundaries), else the response
thread wakes up at its deadline (the steps stalled). With an explicit ``stream_interval`` steps
slower than the interval are never held.

The busy hold also follows the steps: it is at least ``busy_hold_steps`` times the choice's own
recent gap between deltas (an average over its last few steps), up to ``busy_hold_max`` seconds,
so while many streams are open a response carries about three steps' tokens (two at the cap) even
when a step is as long as the hold or longer, and a token waits at most about two steps more.
Never held: a choice's first token, finals (a held delta goes with them), errors (the held tokens
go first), a cancelled request's tokens (dropped).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from backend.outputs import StepDelta
from backend.serving.intake import DeltaArrived, Message

BUSY_STREAMS = 16               # open requests from which busy_stream_interval gathers tokens
BUSY_SCALE_MAX = 2.0            # the busy hold grows with the open streams up to this factor
BUSY_HOLD_STEPS = 2.5           # the busy hold is at least this many of a choice's gaps between deltas
BUSY_HOLD_MAX = 0.3             # s; ... up to this: ~3 steps a response (2 at the cap), none over 0.3 s
GAP_WEIGHT = 0.3                # weight of the newest gap in a choice's average gap between deltas
DUE_SLACK = 0.001               # s; held deltas due this soon go with the ones due now (one wake-up)


class Pace:
    """When a choice's last delta came and the average gap between its deltas (0: not known yet)."""
    __slots__ = ("last", "gap")

    def __init__(self, last: float) -> None:
        self.last = last
        self.gap = 0.0

    def arrived(self, now: float) -> float:
        """Note a delta that came ``now``; returns the average gap so far."""
        gap = now - self.last
        self.last = now
        self.gap = gap if self.gap == 0.0 else self.gap + GAP_WEIGHT * (gap - self.gap)
        return self.gap


@dataclass(slots=True)
class HoldPolicy:
    stream_interval: float = 0.0
    busy_stream_interval: float = 0.0
    busy_hold_steps: float = BUSY_HOLD_STEPS
    busy_hold_max: float = BUSY_HOLD_MAX
    busy_streams: int = BUSY_STREAMS

    def interval(self, open_requests: int, gap: float = 0.0) -> float:
        """``stream_interval`` if set; else, while at least ``busy_streams`` requests are open (each
        response's IPC and downstream work is worth sharing between steps), the larger of
        ``busy_stream_interval`` times (open requests / ``busy_streams``, at most BUSY_SCALE_MAX)
        and ``busy_hold_steps`` times ``gap``, the choice's average gap between deltas (up to
        ``busy_hold_max``); else 0."""
        if self.stream_interval > 0:
            return self.stream_interval
        if self.busy_stream_interval > 0 and open_requests >= self.busy_streams:
            # Grows with the open streams: the responses per second stay about busy_streams /
            # busy_stream_interval however many are open, so the stack's CPU per response (send
            # IPC, ensemble hop, gRPC, shim) stops growing with the load.
            hold = self.busy_stream_interval * min(open_requests / self.busy_streams, BUSY_SCALE_MAX)
            # Steps nearly as long as that or longer would make (nearly) every token its own
            # response: hold across the next two steps, so a response carries three steps' tokens.
            return max(hold, min(self.busy_hold_steps * gap, self.busy_hold_max))
        return 0.0


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
