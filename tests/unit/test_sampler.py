"""Sampler on hand-made logits: each processor's exact effect, seeds, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from backend.engine.sampler import Sampler
from backend.engine.sequence import Request
from backend.engine.admission import InvalidSamplingParam, SamplingParams

V = 8
EOS = 7


def seq(prompt=(0,), output=(), **kw):
    kw.setdefault("max_tokens", 16)
    p = SamplingParams(**kw)
    r = Request("r", list(prompt), p, max_tokens=p.max_tokens, stream=True, salt=None, priority=0,
                deadline=None, arrival_time=0.0)
    s = r.seqs[0]
    s.token_ids.extend(output)
    return s


def sampler():
    return Sampler(V, [EOS], seed=0)


def logits(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_greedy_is_argmax_per_row():
    toks, lps = sampler()(logits([0, 1, 5, 2, 0, 0, 0, 0], [9, 1, 5, 2, 0, 0, 0, 0]),
                          [seq(temperature=0), seq(temperature=0)])
    assert toks == [2, 0] and lps == [None, None]


def test_top_k_1_and_tiny_top_p_are_greedy_even_at_high_temperature():
    row = [0.0, 1.0, 3.0, 2.9, 0.0, 0.0, 0.0, 0.0]
    s = sampler()
    for _ in range(20):
        toks, _ = s(logits(row, row), [seq(temperature=5, top_k=1), seq(temperature=5, top_p=0.01)])
        assert toks == [2, 2]


def test_top_k_and_min_p_restrict_the_support():
    row = [0.0, 1.0, 3.0, 2.9, 2.8, -5.0, -5.0, -5.0]
    s = sampler()
    got_k, got_p = set(), set()
    for _ in range(200):
        toks, _ = s(logits(row, row), [seq(top_k=3), seq(min_p=0.5)])
        got_k.add(toks[0])
        got_p.add(toks[1])
    assert got_k == {2, 3, 4}
    # min_p=0.5: tokens with prob >= half the best one's: logit >= 3 - ln 2
    assert got_p == {2, 3, 4}


def test_sampling_frequencies_follow_the_temperature_scaled_distribution():
    row = torch.tensor([math.log(0.5), math.log(0.3), math.log(0.2)] + [-1e9] * 5)
    s = sampler()
    seqs = [seq(temperature=1.0)] * 4000
    toks, _ = s(row.repeat(4000, 1), seqs)
    freq = torch.bincount(torch.tensor(toks), minlength=V).float() / 4000
    assert torch.allclose(freq[:3], torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_penalties_follow_openai_and_vllm_semantics():
    row = [2.0, -2.0, 1.0, 1.0, 0.5, 0.0, 0.0, 0.0]
    # repetition over prompt + output: positive / rp, negative * rp
    s = seq(prompt=(0, 1), output=(2,), repetition_penalty=2.0, temperature=0)
    out = sampler()._penalize(logits(row), [s])
    assert out[0].tolist() == [1.0, -4.0, 0.5, 1.0, 0.5, 0.0, 0.0, 0.0]
    # frequency and presence over the output only: token 3 twice, token 4 once; prompt ignored
    s = seq(prompt=(0,), output=(3, 3, 4), frequency_penalty=0.5, presence_penalty=0.25, temperature=0)
    out = sampler()._penalize(logits(row), [s])
    assert out[0].tolist() == [2.0, -2.0, 1.0, -0.25, -0.25, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("logprobs", [None, 0], ids=["greedy-fast-path", "full-pipeline"])
def test_min_tokens_masks_eos_and_stop_token_ids_until_reached(logprobs):
    row = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 9.0]     # EOS (7) best, stop id 6 second
    toks, _ = sampler()(logits(row, row, row, row), [
        seq(output=(1,), min_tokens=2, stop_token_ids=[6], temperature=0, logprobs=logprobs),
        seq(output=(1, 2), min_tokens=2, temperature=0, logprobs=logprobs),
        # ignore_eos does not lift the mask (transformers' min_new_tokens): EOS cannot be drawn
        seq(output=(1,), min_tokens=2, ignore_eos=True, temperature=0, logprobs=logprobs),
        seq(output=(1,), min_tokens=2, ignore_eos=True, stop_token_ids=[6], temperature=0, logprobs=logprobs)])
    assert toks == [0, 7, 6, 0]


def test_min_tokens_mask_also_holds_for_sampled_rows():
    row = [0.0] * 6 + [8.0, 9.0]
    s = sampler()
    for _ in range(20):
        toks, _ = s(logits(row, row), [seq(output=(), min_tokens=1, ignore_eos=True, stop_token_ids=[6]),
                                       seq(output=(1,), min_tokens=1, ignore_eos=True)])
        assert toks[0] not in (6, 7) and toks[1] in (6, 7)


def test_greedy_fast_path_equals_the_full_pipeline():
    torch.manual_seed(3)
    batch = torch.randn(16, V)
    batch[::3, EOS] = 10.0                                   # EOS wins on every third row
    plain = [seq(output=(1,) * (i % 4), min_tokens=2, temperature=0) for i in range(16)]
    full = [seq(output=(1,) * (i % 4), min_tokens=2, temperature=0, logprobs=0) for i in range(16)]
    fast_toks, fast_lps = sampler()(batch, plain)
    full_toks, _ = sampler()(batch, full)
    assert fast_toks == full_toks and fast_lps == [None] * 16
    assert EOS in fast_toks and any(t != EOS for t in fast_toks[::3])   # both mask branches ran


def test_rows_map_sequences_to_shared_logits_rows():
    toks, _ = sampler()(logits([0, 9, 0, 0, 0, 0, 0, 0], [0, 0, 9, 0, 0, 0, 0, 0]),
                        [seq(temperature=0)] * 3, rows=[1, 1, 0])
    assert toks == [2, 2, 1]


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    torch.manual_seed(1)
    base = torch.randn(6, V)

    def draw(rows, seeds):
        s = sampler()
        seqs = [seq(seed=sd, temperature=1.0) for sd in seeds]
        out = []
        for _ in range(10):                      # the generators advance step after step
            out.append(s(base[rows], seqs)[0])
        return out

    alone = [t[0] for t in draw([0], [42])]
    mixed = [t[2] for t in draw([3, 1, 0, 5], [None, 7, 42, None])]
    assert alone == mixed
    assert [t[0] for t in draw([0], [43])] != alone


def test_logprobs_are_raw_model_logprobs_with_top_k_best_first():
    row = [1.0, 3.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    raw = torch.log_softmax(logits(row), -1)[0]
    toks, lps = sampler()(logits(row, row), [seq(temperature=0, logprobs=2, repetition_penalty=1.5),
                                             seq(temperature=0, logprobs=0)])
    lp = lps[0]
    assert lp.token_id == toks[0] == 1
    assert lp.logprob == pytest.approx(raw[1].item())
    assert [t for t, _ in lp.top] == [1, 2]
    assert [v for _, v in lp.top] == pytest.approx([raw[1].item(), raw[2].item()])
    assert lps[1].top == [] and lps[1].logprob == pytest.approx(raw[1].item())


@pytest.mark.parametrize("kw, name", [
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-3), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(n=0), "n"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(logprobs=99), "logprobs"),
    (dict(max_tokens=0), "max_tokens"), (dict(seed="x"), "seed"), (dict(stop=[""]), "stop"),
    (dict(temperature=float("nan")), "temperature")])
def test_invalid_settings_raise_value_errors_naming_the_setting(kw, name):
    with pytest.raises(InvalidSamplingParam, match=name) as info:
        SamplingParams(**kw)
    assert isinstance(info.value, ValueError) and info.value.param == name
