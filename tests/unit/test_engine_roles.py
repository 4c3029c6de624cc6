"""backend/engine/roles.py: every engine EngineLoop drives (the unified LLMEngine and both
disaggregation roles' wrappers) satisfies StepEngine member by member, and only a loop that takes
hand-over records (role=decode's DecodeLoop) counts as a HandoverLoop."""
import pytest

from backend.config import EngineArgs
from backend.engine.engine_loop import EngineLoop
from backend.engine.llm_engine import LLMEngine
from backend.engine.roles import HandoverLoop, StepEngine, takes_handover
from backend.serving.disagg_engine import DecodeLoop, build_role
from tests.conftest import model_dir
from tests.unit.protocol_check import mismatches


def _args(role: str) -> EngineArgs:
    return EngineArgs(num_kv_blocks=64, block_size=16, max_num_batched_tokens=256, num_threads=1, role=role)


@pytest.fixture(scope="module")
def loops():
    built = {"unified": EngineLoop(LLMEngine(model_dir("tiny"), _args("unified").engine))}
    for role in ("prefill", "decode"):
        engine, loop_cls = build_role(LLMEngine(model_dir("tiny"), _args(role).engine), _args(role).disagg)
        built[role] = loop_cls(engine)
    yield built
    for role, loop in built.items():
        loop.shutdown(drain=False, timeout=2)
        if role != "unified":
            loop.engine.close_role()


@pytest.mark.parametrize("role", ["unified", "prefill", "decode"])
def test_every_engine_the_loop_drives_is_a_step_engine(loops, role):
    engine = loops[role].engine
    assert mismatches(engine, StepEngine) == []
    assert isinstance(engine, StepEngine)


def test_the_llm_engine_class_declares_what_the_loop_calls():
    assert mismatches(LLMEngine, StepEngine) == []


def test_only_the_decode_loop_takes_hand_overs(loops):
    assert type(loops["decode"]) is DecodeLoop
    assert takes_handover(loops["decode"]) and isinstance(loops["decode"], HandoverLoop)
    assert not takes_handover(loops["unified"]) and not isinstance(loops["unified"], HandoverLoop)
    assert not takes_handover(loops["prefill"])


def test_a_loop_that_declares_it_takes_none_takes_none():
    class Declines:
        accepts_handover = False

        def submit(self, request_id, prompt_ids, params=None, *, handover=None, **kw) -> None: ...

    assert isinstance(Declines(), HandoverLoop)      # the shape alone...
    assert not takes_handover(Declines())            # ...is not enough: the flag says no
    assert mismatches(DecodeLoop, HandoverLoop) == []
