"""Offline API in vLLM's shape: ``LLM(model_dir, **engine_options).generate(prompts, params)`` and
``.embed(prompts)`` (pooled final hidden states, backend/engine/embedding.py)."""
from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

from backend.config import EngineArgs
from backend.outputs import decode_delta
from backend.engine.admission import validate_request
from backend.engine.embedding import validate_embed
from backend.engine.llm_engine import LLMEngine
from backend.errors import EngineError, ErrorKind
from backend.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput, StepDelta
from backend.pooling_params import PoolingParams
from backend.engine.admission import SamplingParams


class LLM:
    """Runs the engine in the caller's thread until every prompt is done."""

    def __init__(self, model_dir: Any, **engine_options: Any):
        args = EngineArgs(**engine_options)         # the engine's and LoRA's parts apply offline
        self.engine = LLMEngine(model_dir, args.engine, lora=args.lora)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Outputs in prompt order. ``prompts``: a string, strings, or token-id lists;
        ``sampling_params``: one for all, or one per prompt. Invalid input raises before anything
        runs: ValueError for malformed arguments, EngineError (invalid_request, with ``param``)
        for a request the engine can never run. A full waiting queue just waits for room."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompt_ids = [self._encode(p) for p in prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompt_ids)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_ids):
                raise ValueError(f"got {len(params)} sampling params for {len(prompt_ids)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in prompt_ids]
        for rid, toks, p in zip(ids, prompt_ids, params):
            validate_request(self.engine.limits, rid, toks, p)

        finals: dict[str, dict[int, StepDelta]] = {rid: {} for rid in ids}
        n_of = {rid: p.n for rid, p in zip(ids, params)}
        todo = list(zip(ids, prompt_ids, params))[::-1]
        bar = _progress(len(ids)) if use_tqdm else None

        def delta(d: StepDelta) -> None:
            finals[d.request_id][d.index] = d
            if bar is not None and d.finished and len(finals[d.request_id]) == n_of[d.request_id]:
                bar.update(1)
        self._run(todo, lambda r: self.engine.add_request(r[0], r[1], r[2], stream=False), delta)
        if bar is not None:
            bar.close()
        return [self._output(rid, toks, p, finals[rid]) for rid, toks, p in zip(ids, prompt_ids, params)]

    def embed(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
              pooling_params: PoolingParams | None = None) -> list[EmbeddingRequestOutput]:
        """One vector per prompt, in order (``out.outputs.embedding``), through the same engine
        steps as generation. Invalid input raises EngineError (invalid_request) before anything runs."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompt_ids = [self._encode(p) for p in prompts]
        pooling = pooling_params or PoolingParams()
        ids = [f"embed-{next(self._ids)}" for _ in prompt_ids]
        finals: dict[str, StepDelta] = {}
        todo = list(zip(ids, prompt_ids))[::-1]
        engine = self.engine
        for rid, toks in todo:                   # all-or-nothing: validate before the first add
            validate_embed(engine.limits, engine.pooling_config, rid, toks, pooling)
        self._run(todo, lambda r: engine.add_request(r[0], r[1], stream=False, pooling=pooling),
                  lambda d: finals.__setitem__(d.request_id, d))
        return [EmbeddingRequestOutput(rid, toks, EmbeddingOutput(finals[rid].embedding or []))
                for rid, toks in zip(ids, prompt_ids)]

    def _run(self, todo: list, add: Callable[[Any], None], on_delta: Callable[[StepDelta], None]) -> None:
        """Add the requests of ``todo`` (last first) as the engine's queue takes them (a full queue:
        step, then try again) and step until every request finished."""
        engine = self.engine
        while todo or engine.has_unfinished():
            while todo:
                try:
                    add(todo[-1])
                except EngineError as exc:
                    if exc.kind is not ErrorKind.QUEUE_FULL:
                        raise
                    break
                todo.pop()
            for d in engine.step():
                on_delta(d)

    def _encode(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def _output(self, rid: str, prompt_ids: list[int], p: SamplingParams,
                deltas: dict[int, StepDelta]) -> RequestOutput:
        outs = []
        for index in sorted(deltas):
            d = deltas[index]
            text = "" if self.tokenizer is None else decode_delta(
                self.tokenizer, d.window_ids, d.num_sent, final=True, max_chars=d.max_chars,
                skip_special_tokens=p.skip_special_tokens)
            outs.append(CompletionOutput(index=index, token_ids=d.new_token_ids, text=text,
                                         finish_reason=d.finish_reason,
                                         logprobs=d.logprobs if p.logprobs is not None else None))
        cached = next(iter(deltas.values())).cached_tokens if deltas else 0
        return RequestOutput(request_id=rid, prompt_token_ids=prompt_ids, num_cached_tokens=cached,
                             outputs=outs)


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="generate")
