"""Shared pieces of the speculative decoding tests: a tiny-vocabulary Markov "model" the engine can
run (its next-token distribution depends only on the current token, so exact probabilities are
known), a proposer that draws drafts from a known distribution, a chi-square p-value and Holm's step-down
procedure over a family of them."""
from __future__ import annotations

import torch

from backend.config import EngineConfig
from backend.engine.llm_engine import LLMEngine
from backend.model.runner import ModelInfo
from backend.spec.config import SpeculativeConfig
from backend.spec.proposer import Draft, Proposer
from backend.spec.speculator import Speculator

V = 8          # token 0 is EOS (ignored with ignore_eos)


def markov_table(seed: int = 0) -> torch.Tensor:
    """logits[v] = the next-token logits after token v; spread enough that every cell is sampled."""
    return torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * 1.2


class MarkovRunner:
    """Stands in for ModelRunner: logits of each wanted row = table[input token]."""

    def __init__(self, table: torch.Tensor, num_blocks: int = 4096):
        self.table = table
        self.num_blocks = num_blocks
        self.storage = None
        self.info = ModelInfo(model_type="markov", vocab_size=V, num_layers=1, num_kv_heads=1, head_dim=1,
                              max_model_len=4096, eos_token_ids=[0])
        self.calls = []

    def execute(self, batch) -> torch.Tensor:
        self.calls.append(batch)
        return self.table[batch.input_ids[batch.logits_indices]].float()


class DistributionProposer(Proposer):
    """Drafts drawn from a fixed distribution ``q`` (any q keeps verification exact)."""
    method = "test_q"

    def __init__(self, q: torch.Tensor, seed: int = 1, point_mass: bool = False):
        self.q, self.point_mass = q, point_mass
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, seqs, max_drafts):
        out = []
        for k in max_drafts:
            toks = torch.multinomial(self.q, k, replacement=True, generator=self.gen).tolist()
            out.append(Draft(toks, None if self.point_mass else self.q.expand(k, V).clone()))
        return out


def markov_engine(table: torch.Tensor, proposer: Proposer | None = None, k: int = 3, **args) -> LLMEngine:
    args = {"max_num_seqs": 512, "max_num_batched_tokens": 8192, "block_size": 4, "max_waiting": 100000, **args}
    engine = LLMEngine(None, EngineConfig(**args), runner=MarkovRunner(table))
    if proposer is not None:
        cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": k,
                                       "disable_by_batch_size": 1 << 30, "min_accepted_tokens": 0})
        engine.speculator = Speculator(cfg, proposer, engine.max_model_len)
    return engine


def run_all(engine: LLMEngine, requests: list[tuple[str, list[int], object]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params, stream=False)
    while engine.has_unfinished():
        for d in engine.step():
            if d.finished:
                out[f"{d.request_id}/{d.index}"] = d.new_token_ids
    return out


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed ``counts`` under ``probs`` (cells with expected < 5 pooled)."""
    n = counts.sum()
    expected = probs * n
    keep = expected >= 5
    obs = torch.cat([counts[keep].double(), counts[~keep].double().sum().view(1)])
    exp = torch.cat([expected[keep].double(), expected[~keep].double().sum().view(1)])
    if exp[-1] < 5:            # too little pooled mass: fold it into the last kept cell
        obs, exp = obs[:-2].tolist() + [obs[-2] + obs[-1]], exp[:-2].tolist() + [exp[-2] + exp[-1]]
        obs, exp = torch.tensor(obs, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64)
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def holm_rejections(pvalues: dict, alpha: float) -> dict:
    """Holm's step-down procedure: the hypotheses (keys of ``pvalues``) rejected with a family-wise
    error rate of at most ``alpha``. Sorted ascending, the i-th smallest p (0-based) is rejected
    while p <= alpha / (m - i); the first one kept stops it."""
    m = len(pvalues)
    out = {}
    for i, (key, p) in enumerate(sorted(pvalues.items(), key=lambda kv: kv[1])):
        if p > alpha / (m - i):
            break
        out[key] = p
    return out
