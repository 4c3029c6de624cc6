"""The wire protocol: model names, tensor names / dtypes / dims, and request parameter names.

Everything that reads or writes a Triton tensor or a request parameter -- the model.py adapters,
backend/serving (responses, tensors, request_params), postprocessing and the clients -- names it
through this module, and tests/unit/test_protocol.py checks it against every
``model_repository/*/config.pbtxt``, so a tensor renamed in one place only fails a test instead of
failing a request at run time.

    client --text_input | messages--> llm (ensemble)
        preprocessing: text_input | messages -> input_ids
        engine:        input_ids -> output_ids, window_ids, num_sent, max_chars, finish_reason, index,
                                    prompt_tokens, completion_tokens, cached_tokens, logprobs, metrics,
                                    text_output, text_logprobs (detokenized in the engine's response
                                    thread; only the outputs a caller requests are built)
    client <--text_output, finish_reason, index, *_tokens, output_ids, logprobs, metrics--

The ``postprocessing`` model (token windows -> text) stays in the repository for token-id clients.

Request parameters are OpenAI's names; the same parameters reach every step of the ensemble.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.param_codec import (  # noqa: F401 - re-exported: P.<NAME> everywhere
    ABORT_REQUEST_ID, BOOL_PARAMS, CACHE_SALT, DIMENSIONS, EMBED, FLOAT_PARAMS, FREQUENCY_PENALTY,
    GUIDED_CHOICE, GUIDED_GRAMMAR, GUIDED_JSON, GUIDED_REGEX, HANDOVER, IGNORE_EOS, INT_PARAMS, LIST_PARAMS,
    LOGIT_BIAS, LOGPROBS_PARAM, LORA, LORA_ADMIN, MAX_COMPLETION_TOKENS, MAX_TENANT_CHARS, MAX_TOKENS,
    MIN_P, MIN_TOKENS, N, NORMALIZE, PARALLEL_TOOL_CALLS, PRESENCE_PENALTY, RENAMED_PARAMS,
    REPETITION_PENALTY, REQUEST_PRIORITY, REQUEST_TIMEOUT, RESERVED_PARAMS, RESPONSE_FORMAT,
    SAMPLING_PARAMS, SEED, SKIP_SPECIAL_TOKENS, SPECULATIVE, STOP, STOP_TOKEN_IDS, STREAM,
    STRUCTURED_PARAMS, TEMPERATURE, TENANT, TEST_FAULT, TOOL_CHOICE, TOOLS, TOP_K, TOP_LOGPROBS, TOP_P)

# -- models --------------------------------------------------------------------------------------
ENSEMBLE = "llm"
PREPROCESSING = "preprocessing"
ENGINE = "engine"
POSTPROCESSING = "postprocessing"

# -- tensors -------------------------------------------------------------------------------------
TEXT_INPUT = "text_input"           # a prompt
MESSAGES = "messages"               # OpenAI chat messages as JSON
INPUT_IDS = "input_ids"
OUTPUT_IDS = "output_ids"           # the response's new token ids
WINDOW_IDS = "window_ids"           # context + new ids, detokenized statelessly (backend/outputs.py decode_delta)
NUM_SENT = "num_sent"               # ids of the window whose text was already sent
MAX_CHARS = "max_chars"             # a stop string's cut of the final text (-1: none)
FINISH_REASON = "finish_reason"     # "" while running | stop | length | abort | error
INDEX = "index"                     # the choice (n > 1)
PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"
CACHED_TOKENS = "cached_tokens"
LOGPROBS = "logprobs"               # JSON (engine: ids; ensemble: OpenAI chat shape) or ""
METRICS = "metrics"                 # JSON {"queue_time","ttft","num_preemptions"} on the final response
TEXT_OUTPUT = "text_output"         # the response's text delta
TEXT_LOGPROBS = "text_logprobs"     # engine: logprobs in the ensemble's (OpenAI chat) shape, or ""
EMBEDDING = "embedding"             # engine: an embedding request's vector (empty for generations)

INT32 = "INT32"
STRING = "STRING"                   # config.pbtxt's TYPE_STRING, tritonclient's "BYTES"
FP32 = "FP32"


@dataclass(frozen=True)
class TensorSpec:
    """One input or output as config.pbtxt declares it (``data_type: TYPE_<dtype>``)."""
    name: str
    dtype: str
    dims: tuple[int, ...]
    optional: bool = False

    @property
    def client_dtype(self) -> str:
        """The datatype tritonclient's InferInput takes."""
        return "BYTES" if self.dtype == STRING else self.dtype


@dataclass(frozen=True)
class ModelIO:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def input(self, name: str) -> TensorSpec:
        return next(t for t in self.inputs if t.name == name)


def _ids(name: str, optional: bool = False) -> TensorSpec:
    return TensorSpec(name, INT32, (-1,), optional)


def _int1(name: str) -> TensorSpec:
    return TensorSpec(name, INT32, (1,))


def _str1(name: str, optional: bool = False) -> TensorSpec:
    return TensorSpec(name, STRING, (1,), optional)


PROMPT_INPUTS = (_str1(TEXT_INPUT, optional=True), _str1(MESSAGES, optional=True))
# The engine's outputs, in the order engine_outputs() builds them (backend/serving/postprocess.py).
# The first eleven are token-level (what postprocessing takes); the last two are the same response
# detokenized in the engine, which the ensemble returns directly (no postprocessing hop per token).
ENGINE_TOKEN_OUTPUTS = (_ids(OUTPUT_IDS), _ids(WINDOW_IDS), _int1(NUM_SENT), _int1(MAX_CHARS),
                        _str1(FINISH_REASON), _int1(INDEX), _int1(PROMPT_TOKENS), _int1(COMPLETION_TOKENS),
                        _int1(CACHED_TOKENS), _str1(LOGPROBS), _str1(METRICS))
ENGINE_OUTPUTS = ENGINE_TOKEN_OUTPUTS + (_str1(TEXT_OUTPUT), _str1(TEXT_LOGPROBS),
                                        TensorSpec(EMBEDDING, FP32, (-1,)))
# What a text client gets: the engine's outputs detokenized (window/num_sent/max_chars -> text).
TEXT_OUTPUTS = (_str1(TEXT_OUTPUT), _str1(FINISH_REASON), _ids(OUTPUT_IDS), _int1(INDEX), _int1(PROMPT_TOKENS),
                _int1(COMPLETION_TOKENS), _int1(CACHED_TOKENS), _str1(LOGPROBS), _str1(METRICS))
# Engine outputs postprocessing copies unchanged (it rewrites text_output, finish_reason, logprobs).
PASS_THROUGH = (OUTPUT_IDS, INDEX, PROMPT_TOKENS, COMPLETION_TOKENS, CACHED_TOKENS, METRICS)

MODELS: dict[str, ModelIO] = {
    ENSEMBLE: ModelIO(PROMPT_INPUTS, TEXT_OUTPUTS),
    PREPROCESSING: ModelIO(PROMPT_INPUTS, (_ids(INPUT_IDS),)),
    ENGINE: ModelIO((_ids(INPUT_IDS, optional=True),), ENGINE_OUTPUTS),
    POSTPROCESSING: ModelIO(ENGINE_TOKEN_OUTPUTS, TEXT_OUTPUTS),
}

# -- request parameters: names, types and codec in common/param_codec.py (imported above) ------

# Prefill/decode disaggregation (docs/disaggregation.md): a prefill engine ends a request it hands
# over with finish_reason FINISH_HANDOVER and no tokens; the record (backend/disagg/handover.py, JSON
# text) rides under key HANDOVER in that final response's METRICS JSON, which every ensemble step
# passes through unchanged (PASS_THROUGH). The front sends the continuation -- the same request plus
# parameter HANDOVER = the record -- to a decode engine, which streams from the first token.
FINISH_HANDOVER = "handover"

# Model-level parameters (config.pbtxt ``parameters``), not per request.
MODEL_DIR = "model_dir"
CONTEXT_WINDOW = "context_window"   # preprocessing: the engine's context_window() (backend/context.py)
# engine: what its weights are, written by generate_repository() (backend/quant/apply.py
# reported_parameters) and read back by the clients for /v1/models. Not engine options.
WEIGHTS_DTYPE = "weights_dtype"                 # the resolved model dtype ("auto" -> float32 on CPU)
WEIGHTS_QUANTIZATION = "weights_quantization"   # none | int8 | int4 (a packed checkpoint's own)
WEIGHTS_GROUP_SIZE = "weights_group_size"       # int4's group; "" when none or per channel
WEIGHT_BYTES = "weight_bytes"                   # parameters as resident in memory
WEIGHTS_PARAMS = (WEIGHTS_DTYPE, WEIGHTS_QUANTIZATION, WEIGHTS_GROUP_SIZE, WEIGHT_BYTES)
