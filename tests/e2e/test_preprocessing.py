"""preprocessing over a real tritonserver: the checkpoint's chat template, clear rejections of bad
prompts, and the other parameters passed through to the engine unread."""
from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException
from transformers import AutoTokenizer

from tests.e2e.helpers import generate

pytestmark = pytest.mark.e2e

MESSAGES = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "你好，世界！ Hello 😀🎉 naïve café"},
    {"role": "assistant", "content": "嗨 👋"},
    {"role": "user", "content": [{"type": "text", "text": "再说一次 "}, {"type": "text", "text": "🚀"}]},
]


def _bytes_input(name: str, text: str) -> grpcclient.InferInput:
    inp = grpcclient.InferInput(name, [1], "BYTES")
    inp.set_data_from_numpy(np.array([text.encode("utf-8")], dtype=np.object_))
    return inp


def preprocess(server, *, messages=None, text=None, **params) -> list[int]:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = []
    if messages is not None:
        inputs.append(_bytes_input("messages", messages if isinstance(messages, str) else json.dumps(messages)))
    if text is not None:
        inputs.append(_bytes_input("text_input", text))
    result = client.infer("preprocessing", inputs, parameters=params or None)
    return result.as_numpy("input_ids").tolist()


def test_chat_template_ids_match_transformers(triton_server):
    tok = AutoTokenizer.from_pretrained(str(triton_server.model_dir))
    flat = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
             else "".join(p["text"] for p in m["content"])} for m in MESSAGES]
    expected = tok.apply_chat_template(flat, add_generation_prompt=True, return_dict=False)
    assert preprocess(triton_server, messages=MESSAGES, temperature=0.7, max_tokens=8) == list(expected)


def test_plain_prompt_ids_match_tokenizer(triton_server):
    tok = AutoTokenizer.from_pretrained(str(triton_server.model_dir))
    text = "  Once upon a time 在很久以前 🐉"
    assert preprocess(triton_server, text=text) == tok.encode(text)


@pytest.mark.parametrize("kwargs, param", [
    ({"text": ""}, "text_input"),
    ({"messages": "not json {"}, "messages"),
    ({"messages": "[]"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": {"role": "user", "content": "hi"}}, "messages"),
    ({"text": "a " * 1500}, "text_input"),
])
def test_bad_requests_get_tagged_errors(triton_server, kwargs, param):
    with pytest.raises(InferenceServerException) as info:
        preprocess(triton_server, **kwargs)
    assert f"[invalid_request param={param}]" in str(info.value)
    # ... and the next valid request is answered normally.
    assert preprocess(triton_server, text="hello")


@pytest.mark.parametrize("params, param", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"), ({"max_tokens": 10**9}, "max_tokens"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": "nan"}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"stop": "[1, 2]"}, "stop"), ({"n": 99}, "n"),
])
def test_generation_parameters_pass_through_to_the_engine(triton_server, params, param):
    """Preprocessing reads only the prompt's parameters: the rest reach the engine unread, whose
    intake (the one reader) refuses a bad one with the same tag through the ensemble."""
    assert preprocess(triton_server, text="hi", **params)
    res = generate(triton_server, "llm", text="hi", **params)
    assert res.error is not None and f"[invalid_request param={param}]" in res.error, res


def test_neither_or_both_inputs_rejected(triton_server):
    for kwargs in ({}, {"text": "hi", "messages": MESSAGES}):
        with pytest.raises(InferenceServerException, match=r"\[invalid_request param=text_input\]"):
            preprocess(triton_server, **kwargs)


def test_wrong_dtype_rejected_by_triton(triton_server):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    inp = grpcclient.InferInput("text_input", [1], "INT32")
    inp.set_data_from_numpy(np.array([5], dtype=np.int32))
    with pytest.raises(InferenceServerException, match="data-type is .INT32."):
        client.infer("preprocessing", [inp])
