"""The per-request opt-out reaches serving: the ``speculative`` request parameter (a boolean, as
Triton parameters and JSON give it) becomes ``SamplingParams.speculative``, and a request parsed
with it set to false never carries draft tokens while the same request without it does."""
from __future__ import annotations

import pytest

from backend import LLM
from backend import protocol as P
from backend.errors import EngineError
from backend.serving.intake import request_settings
from tests.conftest import model_dir

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "min_accepted_tokens": 0}


@pytest.mark.parametrize("raw, want", [(None, True), (False, False), ("false", False), ("0", False),
                                       (True, True), ("true", True), (1, True)])
def test_the_parameter_sets_sampling_speculative(raw, want):
    params = {} if raw is None else {P.SPECULATIVE: raw}
    assert request_settings(params).sampling.speculative is want


def test_a_bad_value_names_the_parameter():
    with pytest.raises(EngineError) as exc:
        request_settings({P.SPECULATIVE: "maybe"})
    assert exc.value.param == P.SPECULATIVE


def test_opted_out_request_drafts_nothing_and_answers_the_same():
    llm = LLM(model_dir("tiny"), num_kv_blocks=64, speculative_config=NGRAM)
    prompt = "red green blue " * 8
    answers, drafted = [], []
    for params in ({P.SPECULATIVE: "false"}, {}):
        sp = request_settings({P.MAX_TOKENS: 16, P.TEMPERATURE: 0, P.IGNORE_EOS: True, **params}).sampling
        before = llm.engine.stats().spec_drafted_tokens
        answers.append(llm.generate([prompt], sp)[0].outputs[0].token_ids)
        drafted.append(llm.engine.stats().spec_drafted_tokens - before)
    assert drafted[0] == 0 and drafted[1] > 0
    assert answers[0] == answers[1]
