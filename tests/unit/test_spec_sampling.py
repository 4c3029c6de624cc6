"""Sampling with speculation has exactly the distribution of plain sampling.

On a tiny-vocabulary Markov model (tests/unit/spec_helpers.py: exact probabilities known), 20k
requests of 5 sampled tokens each (5k for each of 4 prompts) run through the whole engine
(scheduler, KV rollback, the verifier) with drafts from prompt lookup (a point mass) or from a
fixed distribution q (the general min(1, p/q) test with residual resampling). Each (prompt,
position) is one chi-square test against the exact marginal; the 20 tests form one family, and
Holm's procedure keeps its family-wise error at 1 %: a correct sampler fails this test with
probability at most 0.01 whatever the seed (the engine's default seed 0, not chosen). The same
family test rejects a verifier that draws from p instead of the residual after a rejection, and
samples from a 5 % mixture with a wrong distribution. Seeded requests repeat exactly.
"""
from __future__ import annotations

import pytest
import torch

import backend.spec.verify
from backend.engine.admission import SamplingParams
from backend.spec.ngram import NgramProposer
from tests.unit.spec_helpers import (V, DistributionProposer, chi_square_p, holm_rejections, markov_engine,
                                     markov_table, run_all)

PER_PROMPT = 5_000
# prompt lookup proposes the repeated pattern's continuation (3 1 2 ..., 6 4 5 ..., ...)
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
PROMPTS = (PROMPT, [4, 5, 6, 4, 5, 6, 4, 5], [2, 7, 2, 7, 2, 7], [6, 3, 6, 3, 6, 3, 6])
POSITIONS = 5
TEMPERATURE = 0.8
ALPHA = 0.01                 # family-wise


def exact_marginals(table: torch.Tensor, last: int, positions: int) -> list[torch.Tensor]:
    step = torch.softmax(table.double() / TEMPERATURE, dim=-1)      # step[a, b] = P(b | a)
    dist = torch.zeros(V, dtype=torch.float64)
    dist[last] = 1.0
    out = []
    for _ in range(positions):
        dist = dist @ step
        out.append(dist)
    return out


PROPOSERS = {
    "ngram": lambda: NgramProposer(1, 3),
    "q_point_mass": lambda: DistributionProposer(torch.full((V,), 1.0 / V), point_mass=True),
    "q_distribution": lambda: DistributionProposer(torch.softmax(torch.arange(V, dtype=torch.float32) / 3, 0)),
    "off": lambda: None,
}


def family_pvalues(engine, table: torch.Tensor, per_prompt: int) -> dict[tuple[int, int], float]:
    """{(prompt, position): chi-square p of the engine's tokens there against the exact marginal}."""
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=POSITIONS, ignore_eos=True)
    reqs = [(f"p{c}-{i}", prompt, params) for i in range(per_prompt) for c, prompt in enumerate(PROMPTS)]
    outs = run_all(engine, reqs)
    pvalues = {}
    for c, prompt in enumerate(PROMPTS):
        samples = torch.tensor([outs[f"p{c}-{i}/0"] for i in range(per_prompt)])
        assert samples.shape == (per_prompt, POSITIONS)
        for pos, probs in enumerate(exact_marginals(table, prompt[-1], POSITIONS)):
            pvalues[(c, pos)] = chi_square_p(torch.bincount(samples[:, pos], minlength=V), probs)
    return pvalues


@pytest.mark.parametrize("name", ["ngram", "q_distribution"])     # the point-mass and general paths
def test_sampled_distribution_matches_plain_sampling(name):
    table = markov_table()
    engine = markov_engine(table, PROPOSERS[name]())
    pvalues = family_pvalues(engine, table, PER_PROMPT)
    stats = engine.stats()
    n = PER_PROMPT * len(PROMPTS)
    # positions 1.. come from verification steps that accepted drafts
    assert stats.spec_drafted_tokens > n // 2 and 0 < stats.spec_accepted_tokens < stats.spec_drafted_tokens
    assert len(pvalues) == len(PROMPTS) * POSITIONS
    assert not holm_rejections(pvalues, ALPHA), (name, sorted(pvalues.items(), key=lambda kv: kv[1])[:3])
    assert stats.kv.num_used_blocks == 0
    engine.kv.check_integrity()


def _residual_ignored(sampler, seq, drafts, probs):
    """backend/spec/verify.py's _sampled_run with a classic bug: after a rejected draft the token is
    drawn from p instead of the normalised residual (p - q)+."""
    gen, q = seq.generator, seq.spec_probs
    run = []
    for j, x in enumerate(drafts):
        if sampler.uniform(gen) * float(q[j, x]) < float(probs[j][x]):
            run.append(x)
            continue
        run.append(sampler.race(probs[j], gen))
        return run
    run.append(sampler.race(probs[len(drafts)], gen))
    return run


def test_the_family_test_rejects_a_wrong_verifier(monkeypatch):
    """The test has power: the engine with a wrong verifier fails it, at a fifth of the samples."""
    table = markov_table()
    monkeypatch.setattr(backend.spec.verify, "_sampled_run", _residual_ignored)
    engine = markov_engine(table, PROPOSERS["q_distribution"]())
    rejected = holm_rejections(family_pvalues(engine, table, PER_PROMPT // 5), ALPHA)
    assert rejected and all(pos > 0 for _, pos in rejected)     # position 0 is never a verified draft


def test_the_family_test_rejects_a_slightly_wrong_distribution():
    """Samples from 0.95 p + 0.05 q at every (prompt, position), as many as the engine test draws."""
    table = markov_table()
    q = torch.softmax(torch.arange(V, dtype=torch.float64) / 3, 0)
    gen = torch.Generator().manual_seed(0)
    pvalues = {}
    for c, prompt in enumerate(PROMPTS):
        for pos, p in enumerate(exact_marginals(table, prompt[-1], POSITIONS)):
            drawn = torch.multinomial(0.95 * p + 0.05 * q, PER_PROMPT, replacement=True, generator=gen)
            pvalues[(c, pos)] = chi_square_p(torch.bincount(drawn, minlength=V), p)
    assert holm_rejections(pvalues, ALPHA)          # the family test fails


@pytest.mark.parametrize("name", ["ngram", "q_distribution"])
def test_seeded_requests_repeat_exactly(name):
    table = markov_table()
    params = [SamplingParams(temperature=1.0, max_tokens=12, seed=s, ignore_eos=True, n=2) for s in range(20)]

    def run(proposer_seed: int, others: int):
        engine = markov_engine(table, PROPOSERS[name]() if name == "ngram" else DistributionProposer(
            torch.softmax(torch.arange(V, dtype=torch.float32) / 3, 0), seed=proposer_seed))
        reqs = [(f"s{i}", PROMPT, p) for i, p in enumerate(params)]
        reqs += [(f"x{i}", [5, 6, 7, 5, 6], SamplingParams(temperature=1.0, max_tokens=7)) for i in range(others)]
        outs = run_all(engine, reqs)
        return {k: v for k, v in outs.items() if k.startswith("s")}

    first = run(1, 0)
    assert first == run(1, 0)
    if name == "ngram":                 # other (unseeded) traffic in the batch changes nothing
        assert first == run(1, 5)       # (the test q proposer shares one generator, so not there)
    assert len({tuple(v) for v in first.values()}) > 15     # choice i of seed s = choice 0 of s + i


def test_seeded_prompt_lookup_equals_seeded_plain_sampling():
    """With a point-mass proposer each emitted token consumes one draw, as plain sampling does:
    a seeded request's tokens are the same with and without prompt lookup."""
    table = markov_table()
    params = [SamplingParams(temperature=1.0, max_tokens=16, seed=s, ignore_eos=True) for s in range(30)]
    reqs = [(f"s{i}", PROMPT, p) for i, p in enumerate(params)]
    spec_engine = markov_engine(table, NgramProposer(1, 3))
    assert run_all(spec_engine, reqs) == run_all(markov_engine(table), reqs)
    assert spec_engine.stats().spec_accepted_tokens > 0
