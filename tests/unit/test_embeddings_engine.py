"""Embedding requests in the one engine (backend/engine/embedding.py): vectors equal transformers'
pooled final hidden states (fp32, 1e-4) under last-token and mean pooling, chunked prefill included;
a batch gives the same vectors as one by one; KV is idle and nothing is cached afterwards; greedy
generations running beside embeddings do not change; bad requests are EngineErrors naming the field."""
from __future__ import annotations

import functools
import json
import pathlib

import pytest
import torch

from backend import LLM, SamplingParams
from backend.errors import EngineError
from backend.pooling_params import PoolingParams
from tests.conftest import model_dir

LENGTHS = [1, 3, 7, 15, 16, 17, 31, 40, 64, 90, 150, 5, 23, 33, 48, 70]
OPTIONS = dict(num_kv_blocks=64, block_size=16, max_num_seqs=16, max_num_batched_tokens=64, num_threads=1)


def prompts(lengths=LENGTHS, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 3000, (n,), generator=g).tolist() for n in lengths]


@functools.cache
def hf_hidden(path: str) -> tuple:
    """transformers' final-normed hidden states [n, hidden] fp32 per prompt of ``prompts()``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return tuple(model.model(torch.tensor([p])).last_hidden_state[0] for p in prompts())


def st_model(tmp: pathlib.Path, mode: str, *, normalize: bool, config_extra: dict | None = None) -> pathlib.Path:
    """The tiny checkpoint with a sentence-transformers pooling config (and config.json additions)."""
    src = model_dir("tiny")
    tmp.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json":
            (tmp / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config_extra or {})
    (tmp / "config.json").write_text(json.dumps(cfg))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp / "modules.json").write_text(json.dumps(modules))
    (tmp / "1_Pooling").mkdir()
    (tmp / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 256,
                                                              f"pooling_mode_{mode}": True}))
    return tmp


@pytest.fixture(scope="module")
def llm():
    return LLM(str(model_dir("tiny")), **OPTIONS)


def assert_idle(llm: LLM, cached_before: int = 0) -> None:
    kv = llm.engine.kv
    assert not llm.engine.has_unfinished()
    assert kv.stats().num_used_blocks == 0
    assert len(kv.pool.cached) == cached_before, "embedding requests commit nothing to the prefix cache"
    kv.check_integrity()


def test_last_token_normalized_equals_transformers(llm):
    outs = llm.embed(prompts())
    ref = hf_hidden(str(model_dir("tiny")))
    for out, h, p in zip(outs, ref, prompts()):
        assert out.prompt_token_ids == p
        want = torch.nn.functional.normalize(h[-1], dim=0)
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert_idle(llm)


def test_unnormalized_last_token_and_batch_equals_one_by_one(llm):
    ps = prompts([(7 * i) % 97 + 1 for i in range(64)], seed=1)
    batched = llm.embed(ps, PoolingParams(normalize=False))
    for i in (0, 5, 31, 63):
        alone = llm.embed([ps[i]], PoolingParams(normalize=False))[0].outputs.embedding
        torch.testing.assert_close(torch.tensor(batched[i].outputs.embedding), torch.tensor(alone),
                                   atol=1e-5, rtol=0)
    ref = hf_hidden(str(model_dir("tiny")))
    raw = llm.embed(prompts()[:4], PoolingParams(normalize=False))
    for out, h in zip(raw, ref):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), h[-1], atol=1e-4, rtol=0)
    assert_idle(llm)


def test_mean_pooling_from_sentence_transformers_config(tmp_path):
    path = st_model(tmp_path / "st-mean", "mean_tokens", normalize=True)
    llm = LLM(str(path), **OPTIONS)
    assert llm.engine.pooling_config.pooling_type == "mean"
    ref = hf_hidden(str(model_dir("tiny")))
    for out, h in zip(llm.embed(prompts()), ref):
        want = torch.nn.functional.normalize(h.mean(0), dim=0)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-4, rtol=0)
    assert_idle(llm)


def test_sentence_transformers_without_normalize_returns_raw_vectors(tmp_path):
    llm = LLM(str(st_model(tmp_path / "st-last", "lasttoken", normalize=False)), **OPTIONS)
    h = hf_hidden(str(model_dir("tiny")))[3]
    got = torch.tensor(llm.embed([prompts()[3]])[0].outputs.embedding)
    torch.testing.assert_close(got, h[-1], atol=1e-4, rtol=0)


def test_matryoshka_dimensions_truncate_then_renormalize(tmp_path):
    path = st_model(tmp_path / "mrl", "lasttoken", normalize=True, config_extra={"matryoshka_dimensions": [64, 128]})
    llm = LLM(str(path), **OPTIONS)
    h = hf_hidden(str(model_dir("tiny")))[5]
    got = torch.tensor(llm.embed([prompts()[5]], PoolingParams(dimensions=64))[0].outputs.embedding)
    torch.testing.assert_close(got, torch.nn.functional.normalize(h[-1][:64], dim=0), atol=1e-4, rtol=0)
    with pytest.raises(EngineError) as exc:
        llm.embed([prompts()[5]], PoolingParams(dimensions=100))
    assert exc.value.param == "dimensions"


@pytest.mark.parametrize("bad, param", [
    (([[]], None), "input_ids"),
    (([[5] * 1025], None), "input_ids"),             # past the context window (64 blocks x 16)
    (([[5, 99999]], None), "input_ids"),
    (([[5, 6]], PoolingParams(dimensions=32)), "dimensions"),      # the tiny model declares no Matryoshka
    (([[5, 6]], PoolingParams(dimensions=0)), "dimensions"),
    (([[5, 6]], PoolingParams(normalize="yes")), "normalize"),
])
def test_bad_requests_name_the_field_and_leave_nothing_behind(llm, bad, param):
    with pytest.raises(EngineError) as exc:
        llm.embed(*bad)
    assert exc.value.param == param
    assert_idle(llm)


def test_full_context_window_input_is_embedded(llm):
    window = llm.engine.max_model_len
    out = llm.embed([[7] * window])[0]
    assert len(out.outputs.embedding) == 256
    assert_idle(llm)


def test_generations_beside_embeddings_are_unchanged():
    """Greedy generations alone, then the same generations with embedding requests joining at
    every step (chunked, sharing steps with decodes and prefill chunks): identical tokens."""
    gen_prompts = prompts([9, 40, 130, 17], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = LLM(str(model_dir("tiny")), **OPTIONS).generate(gen_prompts, params)

    llm = LLM(str(model_dir("tiny")), **OPTIONS)
    engine = llm.engine
    for i, p in enumerate(gen_prompts):
        engine.add_request(f"g{i}", p, params, stream=True)
    emb_prompts = prompts([5, 70, 33, 100, 12, 3] * 4, seed=3)
    tokens: dict[str, list[int]] = {f"g{i}": [] for i in range(len(gen_prompts))}
    vectors = {}
    step = 0
    while engine.has_unfinished() or step < len(emb_prompts):
        if step < len(emb_prompts):
            engine.add_request(f"e{step}", emb_prompts[step], pooling=PoolingParams())
        for d in engine.step():
            if d.request_id.startswith("g"):
                tokens[d.request_id] += d.new_token_ids
            elif d.finished:
                vectors[d.request_id] = d.embedding
        step += 1
    assert [tokens[f"g{i}"] for i in range(len(gen_prompts))] == [o.outputs[0].token_ids for o in alone]
    assert len(vectors) == len(emb_prompts) and all(len(v) == 256 for v in vectors.values())
    ref = LLM(str(model_dir("tiny")), **OPTIONS).embed(emb_prompts[:6])
    for i, r in enumerate(ref):
        torch.testing.assert_close(torch.tensor(vectors[f"e{i}"]), torch.tensor(r.outputs.embedding),
                                   atol=1e-5, rtol=0)
    assert engine.kv.stats().num_used_blocks == 0


def test_abort_frees_the_blocks(llm):
    engine = llm.engine
    engine.add_request("a", [5] * 150, pooling=PoolingParams())
    engine.step()
    assert engine.kv.stats().num_used_blocks > 0
    assert engine.abort_request("a")
    finals = engine.step()
    assert [(d.request_id, d.finish_reason, d.embedding) for d in finals] == [("a", "abort", None)]
    assert_idle(llm)


def test_preempted_mean_pooling_restarts_its_sum(tmp_path):
    """A generation that grows in a 12-block pool preempts the chunked 150-token embedding (the
    later arrival); recomputed from token 0, its mean is still transformers' mean."""
    path = st_model(tmp_path / "st-mean", "mean_tokens", normalize=True)
    llm = LLM(str(path), **{**OPTIONS, "num_kv_blocks": 12, "max_num_batched_tokens": 40})
    engine = llm.engine
    engine.add_request("g", prompts([100], seed=5)[0], SamplingParams(temperature=0, max_tokens=90, ignore_eos=True))
    p = prompts()[10]
    assert len(p) == 150
    engine.add_request("e", p, pooling=PoolingParams())
    finals = {}
    while engine.has_unfinished():
        finals.update({d.request_id: d for d in engine.step() if d.finished})
    assert finals["e"].num_preemptions >= 1
    want = torch.nn.functional.normalize(hf_hidden(str(model_dir("tiny")))[10].mean(0), dim=0)
    torch.testing.assert_close(torch.tensor(finals["e"].embedding), want, atol=1e-4, rtol=0)
    assert engine.kv.stats().num_used_blocks == 0


@pytest.mark.parametrize("spec", ["ngram", "draft_model"])
def test_embeddings_beside_speculative_decoding(spec):
    """Embedding requests never carry draft tokens; the vectors and the speculating generation are
    the same as without speculation."""
    cfg = ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
           if spec == "ngram" else {"method": "draft_model", "model": str(model_dir("tiny")), "num_speculative_tokens": 3})
    gen = [[5, 6, 7, 5, 6, 7, 5, 6] * 4]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(model_dir("tiny")), **OPTIONS)
    want_gen = plain.generate(gen, params)[0].outputs[0].token_ids
    want_emb = plain.embed(prompts()[:6])
    llm = LLM(str(model_dir("tiny")), **OPTIONS, speculative_config=cfg)
    engine = llm.engine
    engine.add_request("g", gen[0], params)
    for i, p in enumerate(prompts()[:6]):
        engine.add_request(f"e{i}", p, pooling=PoolingParams())
    toks, vecs = [], {}
    while engine.has_unfinished():
        for d in engine.step():
            toks += d.new_token_ids if d.request_id == "g" else []
            if d.embedding is not None:
                vecs[d.request_id] = d.embedding
    assert toks == want_gen
    for i, w in enumerate(want_emb):
        torch.testing.assert_close(torch.tensor(vecs[f"e{i}"]), torch.tensor(w.outputs.embedding), atol=1e-5, rtol=0)
    assert engine.kv.stats().num_used_blocks == 0
