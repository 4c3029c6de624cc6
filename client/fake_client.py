"""A scripted stand-in for TritonLLMClient: no server, deterministic text, observable aborts.

    fake = FakeLLMClient()
    app = create_app(settings, client=fake)

The answer to every request is ``REPLY`` cut into pieces of ``piece`` characters (one "token"
each), so stop strings, ``max_tokens`` (finish ``length``), ``n`` and logprobs behave like the real
server's. ``fail_before`` / ``fail_after`` inject errors, ``delay`` slows every token, and a
generation closed before it finished is recorded in ``aborted`` (what the real client turns into
a gRPC cancel plus an explicit abort).
"""
from __future__ import annotations

import asyncio
import math
from typing import AsyncIterator

from client.errors import TritonLLMError, UnavailableError
from client.wire import Chunk

REPLY = "Hello world! 你好，世界 🙂 The quick brown fox jumps over the lazy dog. " * 4


class FakeLLMClient:
    def __init__(self, *, reply: str = REPLY, piece: int = 3, delay: float = 0.0,
                 ready: bool = True, window: int = 1024) -> None:
        self.reply, self.piece, self.delay, self.ready = reply, piece, delay, ready
        self.window = window                    # context_window(); None: the server cannot say
        self.fail_before: TritonLLMError | None = None     # raised instead of the first chunk
        self.fail_after: tuple[int, TritonLLMError] | None = None   # (tokens sent, error)
        self.end_early: int | None = None       # end the stream after k tokens with no finish reason
        self.calls: list[dict] = []
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.closed = False

    async def is_ready(self) -> bool:
        return self.ready

    async def close(self) -> None:
        self.closed = True

    async def context_window(self) -> int:
        if self.window is None:
            raise UnavailableError("the fake server has no context window")
        return self.window

    async def wait_aborts(self) -> None:
        return None

    def tokens(self, params: dict) -> tuple[list[str], str]:
        """The pieces one choice produces and its finish reason."""
        pieces = [self.reply[i:i + self.piece] for i in range(0, len(self.reply), self.piece)]
        finish = "stop"
        stops = params.get("stop") or []
        if stops:
            text = "".join(pieces)
            cut = min((text.find(s) for s in stops if s in text), default=-1)
            if cut >= 0:                 # keep whole pieces before the stop string, then trim
                kept, total = [], 0
                for p in pieces:
                    if total + len(p) > cut:
                        if cut > total:
                            kept.append(p[:cut - total])
                        break
                    kept.append(p)
                    total += len(p)
                pieces = kept + [""]     # the stop token itself emits nothing
        max_tokens = params.get("max_tokens")
        if max_tokens is not None and len(pieces) > max_tokens:
            pieces, finish = pieces[:max_tokens], "length"
        return pieces, finish

    def generate(self, prompt: str | None = None, messages: list[dict] | None = None, *,
                 request_id: str | None = None, params: dict | None = None,
                 stream: bool = True) -> AsyncIterator[Chunk]:
        params = dict(params or {})
        self.calls.append({"prompt": prompt, "messages": messages, "request_id": request_id,
                           "params": params, "stream": stream})
        return self._run(prompt, messages, request_id or "fake", params, stream)

    async def _run(self, prompt, messages, rid: str, params: dict, stream: bool) -> AsyncIterator[Chunk]:
        n = int(params.get("n", 1))
        text_in = prompt if prompt is not None else " ".join(str(m.get("content")) for m in messages)
        prompt_tokens = max(1, math.ceil(len(text_in) / self.piece))
        pieces, finish = self.tokens(params)
        top = params.get("logprobs")
        done = False
        try:
            if self.fail_before is not None:
                done = True              # rejected: nothing to abort
                raise self.fail_before
            if not stream:
                await asyncio.sleep(self.delay * len(pieces))
                if self.fail_after is not None:
                    raise self.fail_after[1]
                if self.end_early is not None:
                    done = True
                    return
                for i in range(n):
                    yield self._chunk(i, "".join(pieces), list(range(len(pieces))), len(pieces),
                                      prompt_tokens, finish, pieces if top is not None else None, top)
                done = True
                return
            for k, p in enumerate(pieces):
                if self.end_early is not None and k == self.end_early:
                    break
                if self.fail_after is not None and k == self.fail_after[0]:
                    raise self.fail_after[1]
                if self.delay:
                    await asyncio.sleep(self.delay)
                last = k == len(pieces) - 1
                for i in range(n):
                    yield self._chunk(i, p, [k], k + 1, prompt_tokens, finish if last else None,
                                      [p] if top is not None else None, top)
            done = True
        finally:
            (self.finished if done else self.aborted).append(rid)

    @staticmethod
    def _chunk(index: int, text: str, ids: list[int], completion_tokens: int, prompt_tokens: int,
               finish: str | None, lp_pieces: list[str] | None, top) -> Chunk:
        logprobs = None
        if lp_pieces is not None:
            logprobs = [{"token": p, "bytes": list(p.encode()), "logprob": -0.5,
                         "top_logprobs": [{"token": p, "bytes": list(p.encode()), "logprob": -0.5}][:int(top)]}
                        for p in lp_pieces]
        metrics = {"queue_time": 0.001, "ttft": 0.01, "num_preemptions": 0} if finish else None
        return Chunk(index=index, text=text, token_ids=ids, finish_reason=finish,
                     prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     cached_tokens=0, logprobs=logprobs, metrics=metrics)
