"""backend/protocol.py against every model_repository/*/config.pbtxt (parsed with Triton's own
ModelConfig protobuf) and against what the adapters actually build.

A tensor renamed, retyped or reshaped in a config.pbtxt only (or in protocol.py only) fails here.
"""
from __future__ import annotations

import pathlib

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from backend import protocol as P
from backend.outputs import StepDelta
from backend.serving.repository import TEMPLATES
from backend.serving.postprocess import control_outputs, engine_outputs

CONFIGS = sorted(TEMPLATES.glob("*/config.pbtxt"))


def load(path: pathlib.Path) -> mc.ModelConfig:
    return text_format.Parse(path.read_text(), mc.ModelConfig())


def specs(tensors) -> dict[str, P.TensorSpec]:
    return {t.name: P.TensorSpec(t.name, mc.DataType.Name(t.data_type).removeprefix("TYPE_"), tuple(t.dims),
                                 bool(getattr(t, "optional", False))) for t in tensors}


def by_name(tensors: tuple[P.TensorSpec, ...]) -> dict[str, P.TensorSpec]:
    return {t.name: t for t in tensors}


def test_every_model_in_the_repository_is_in_the_protocol():
    assert sorted(p.parent.name for p in CONFIGS) == sorted(P.MODELS)
    for path in CONFIGS:
        assert load(path).name == path.parent.name


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.parent.name)
def test_config_tensors_match_the_protocol(path):
    cfg, io = load(path), P.MODELS[path.parent.name]
    assert specs(cfg.input) == by_name(io.inputs)
    assert specs(cfg.output) == by_name(io.outputs)


def test_ensemble_steps_wire_real_tensors():
    """Every step maps existing inputs/outputs of its model; each intermediate is produced before
    it is consumed; every ensemble output is produced by some step."""
    cfg = load(TEMPLATES / P.ENSEMBLE / "config.pbtxt")
    assert specs(cfg.output) == by_name(P.MODELS[P.ENSEMBLE].outputs)
    available = {t.name for t in cfg.input}
    for step in cfg.ensemble_scheduling.step:
        io = P.MODELS[step.model_name]
        assert set(step.input_map) <= {t.name for t in io.inputs}, step.model_name
        assert {t.name for t in io.inputs if not t.optional} <= set(step.input_map), step.model_name
        assert set(step.input_map.values()) <= available, step.model_name
        assert set(step.output_map) <= {t.name for t in io.outputs}, step.model_name
        available |= set(step.output_map.values())
    assert {t.name for t in cfg.output} <= available
    post = [s for s in cfg.ensemble_scheduling.step if s.model_name == P.POSTPROCESSING]
    engine = next(s for s in cfg.ensemble_scheduling.step if s.model_name == P.ENGINE)
    if post:    # the engine's token outputs all reach postprocessing under the same names
        assert {post[0].input_map[k] for k in post[0].input_map} == {engine.output_map[k] for k in post[0].input_map}
    else:       # the engine's text outputs are the ensemble's
        assert engine.output_map[P.TEXT_OUTPUT] == P.TEXT_OUTPUT
        assert engine.output_map[P.TEXT_LOGPROBS] == P.LOGPROBS


def test_pass_through_is_what_postprocessing_copies():
    post = P.MODELS[P.POSTPROCESSING]
    same = {t.name: t for t in post.inputs}.items() & {t.name: t for t in post.outputs}.items()
    # finish_reason and logprobs keep their names but postprocessing rewrites them
    assert set(P.PASS_THROUGH) == {name for name, _ in same} - {P.FINISH_REASON, P.LOGPROBS}


def test_engine_outputs_build_exactly_the_declared_tensors():
    delta = StepDelta(request_id="r", index=0, new_token_ids=[5, 6], finished=True, finish_reason="stop",
                      prompt_tokens=3, completion_tokens=2, window_ids=[4, 5, 6], num_sent=1)
    out = engine_outputs(delta, ttft=0.1, text=("hi", ""))
    declared = by_name(P.ENGINE_OUTPUTS)
    assert list(out) == [t.name for t in P.ENGINE_OUTPUTS]
    # only requested outputs are built; without text the text outputs are left out
    want = {P.TEXT_OUTPUT, P.INDEX}
    assert list(engine_outputs(delta, text=("hi", ""), want=want)) == [P.INDEX, P.TEXT_OUTPUT]
    assert P.TEXT_OUTPUT not in engine_outputs(delta)
    for name, arr in out.items():
        spec = declared[name]
        assert (arr.dtype.kind == "O") == (spec.dtype == P.STRING), name
        if spec.dims == (1,):
            assert arr.shape == (1,), name
    assert set(control_outputs(True)) <= set(declared)


def test_config_parameters_the_code_reads_are_declared():
    pre = load(TEMPLATES / P.PREPROCESSING / "config.pbtxt")
    assert {P.MODEL_DIR, P.CONTEXT_WINDOW} <= set(pre.parameters)
    for name in (P.ENGINE, P.POSTPROCESSING):
        assert P.MODEL_DIR in load(TEMPLATES / name / "config.pbtxt").parameters
