"""Draft-model proposer: a smaller checkpoint with the target's tokenizer, run by the same model
code (backend/model) with its own KV pool and block tables.

Per sequence the draft keeps how many of the sequence's tokens its cache holds. One propose()
call runs the draft k times over all speculating sequences together:

    pass 0   catch-up chunks  token_ids[cached:num_tokens]  (last row -> draft 0)
    pass i   one token each   draft i-1 at position num_tokens + i - 1   (-> draft i)

so after it the draft's cache holds token_ids + drafts[:k-1]. Next step the part that is still
valid is the longest prefix matching the sequence's tokens (the accepted drafts); the rest is
cut back (computed count, tail blocks freed) before catching up again.

Drafts for greedy requests are the draft's argmax (a point mass). For sampled requests they are
drawn from the draft's softmax at the request's temperature, and that distribution goes with the
draft for exact rejection sampling (verify.py); a seeded request draws them from its own
generator (seed-derived, separate from the target's), so seeded runs repeat.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

import torch

from backend.spec.proposer import Draft, Proposer

if TYPE_CHECKING:
    from backend.engine.sequence import Sequence


@dataclass
class _State:
    cached: int = 0                  # leading tokens of the sequence in the draft's KV
    base: int = 0                    # num_tokens when the last drafts were fed
    fed: list[int] = field(default_factory=list)   # drafts written to the cache after base
    generator: torch.Generator | None = None


class DraftModelProposer(Proposer):
    method = "draft_model"

    def __init__(self, model_dir, args, *, num_blocks: int, vocab_size: int):
        from backend.kv_cache.manager import KVCacheManager
        from backend.model.runner import ModelRunner

        # ``args``: the target's EngineConfig. No LoRAConfig for the draft's runner: adapters belong
        # to the target (which verifies with them).
        draft_args = dataclasses.replace(args, num_kv_blocks=num_blocks, enable_prefix_caching=False,
                                         host_tier_blocks=0, disk_tier_blocks=0, disk_tier_path=None)
        self.runner = ModelRunner(str(model_dir), draft_args)
        if self.runner.info.vocab_size != vocab_size:
            raise ValueError(f"draft model vocabulary ({self.runner.info.vocab_size}) differs from the "
                             f"target's ({vocab_size}): it must use the same tokenizer")
        self.kv = KVCacheManager(storage=self.runner.storage, num_blocks=self.runner.num_blocks,
                                 block_size=args.block_size, enable_prefix_caching=False)
        self.max_len = self.runner.info.max_model_len
        self.device = args.device
        self.generator = torch.Generator().manual_seed(args.seed + 1)
        self.states: dict[str, _State] = {}

    # -- state -------------------------------------------------------------------------------
    def release(self, running: Iterable[Sequence]) -> None:
        live = {s.seq_id for s in running}
        for seq_id in [i for i in self.states if i not in live]:
            del self.states[seq_id]
            self.kv.free(seq_id)

    def check_idle(self) -> None:
        assert not self.states, f"draft states left: {sorted(self.states)}"
        assert self.kv.stats().num_used_blocks == 0
        self.kv.check_integrity()

    def _state(self, seq: Sequence) -> _State:
        st = self.states.get(seq.seq_id)
        if st is None:
            st = self.states[seq.seq_id] = _State()
            if seq.params.seed is not None:       # distinct from the target's (seed + index)
                st.generator = torch.Generator().manual_seed((seq.params.seed * 7919 + seq.index + 1) % (1 << 63))
            self.kv.acquire_prefix(seq.seq_id, [], None)
            return st
        # Keep what still matches: the old tokens and the drafts that were accepted.
        valid = st.base
        for tok in st.fed:
            if valid < seq.num_tokens and seq.token_ids[valid] == tok:
                valid += 1
            else:
                break
        st.cached = min(st.cached, valid, seq.num_tokens - 1)
        st.fed = []
        self.kv.truncate(seq.seq_id, st.cached)
        self.kv.commit(seq.seq_id, seq.token_ids, st.cached)
        return st

    # -- proposing ---------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        active = []                                   # (index, state, k)
        for i, (seq, k) in enumerate(zip(seqs, max_drafts)):
            k = min(k, self.max_len - seq.num_tokens)
            st = self._state(seq)
            if k > 0 and self.kv.allocate_slots(seq.seq_id, seq.num_tokens + k - 1):
                active.append((i, st, k))
        if not active:
            return drafts
        probs: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in active}
        feed = {i: seqs[i].token_ids[st.cached:] for i, st, _ in active}
        for step in range(max(k for _, _, k in active)):
            todo = [(i, st, k) for i, st, k in active if k > step]
            logits = self._run([(seqs[i], st, feed[i]) for i, st, _ in todo])
            for row, (i, st, k) in enumerate(todo):
                seq = seqs[i]
                st.cached += len(feed[i])
                tok, p = self._draw(logits[row], seq, st)
                drafts[i].token_ids.append(tok)
                if p is not None:
                    probs[i].append(p)
                feed[i] = [tok]
                if step < k - 1:
                    st.fed.append(tok)
        for i, st, _ in active:
            st.base = seqs[i].num_tokens
            st.cached = st.base + len(st.fed)
            if probs[i]:
                drafts[i].probs = torch.stack(probs[i])
        return drafts

    def _run(self, items: list[tuple[Sequence, _State, list[int]]]) -> torch.Tensor:
        from backend.model.runner import SeqChunk, build_batch

        chunks = [SeqChunk(toks, st.cached, self.kv.block_table(seq.seq_id)) for seq, st, toks in items]
        return self.runner.execute(build_batch(chunks, self.kv.block_size, self.device))

    def _draw(self, logits: torch.Tensor, seq: Sequence, st: _State) -> tuple[int, torch.Tensor | None]:
        if seq.params.greedy:
            return int(logits.argmax()), None
        p = torch.softmax(logits.float() / seq.params.temperature, dim=-1)
        q = torch.empty(p.shape[0]).exponential_(generator=st.generator or self.generator).to(p.device)
        return int((p / q.clamp_min_(1e-20)).argmax()), p
