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
WINDOW_IDS = "window_ids"           # context + new ids, detokenized statelessly (backend/detokenizer.py)
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
# The engine's outputs, in the order engine_outputs() builds them (backend/serving/responses.py).
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

# -- request parameters --------------------------------------------------------------------------
STREAM = "stream"
N = "n"
MAX_TOKENS = "max_tokens"
MAX_COMPLETION_TOKENS = "max_completion_tokens"   # OpenAI's newer name for max_tokens
MIN_TOKENS = "min_tokens"
TEMPERATURE = "temperature"
TOP_P = "top_p"
TOP_K = "top_k"
MIN_P = "min_p"
SEED = "seed"
PRESENCE_PENALTY = "presence_penalty"
FREQUENCY_PENALTY = "frequency_penalty"
REPETITION_PENALTY = "repetition_penalty"
STOP = "stop"                       # JSON list of strings (or one string)
STOP_TOKEN_IDS = "stop_token_ids"   # JSON list of ints
IGNORE_EOS = "ignore_eos"
SKIP_SPECIAL_TOKENS = "skip_special_tokens"
SPECULATIVE = "speculative"         # false: this request never speculates (with speculative_config set)
LOGPROBS_PARAM = "logprobs"         # bool (chat) or int (completions); same name as the tensor
TOP_LOGPROBS = "top_logprobs"
TENANT = "tenant"                   # salts the prefix cache: tenants never share cached blocks
# Triton's front ends consume "priority" and "timeout" themselves (they never reach a model).
REQUEST_PRIORITY = "request_priority"
REQUEST_TIMEOUT = "request_timeout"
ABORT_REQUEST_ID = "abort_request_id"   # a control request to the engine: stop that request
                                        # (only a request of the same tenant)
CACHE_SALT = "cache_salt"           # honoured only with the engine option allow_client_salt
LORA = "lora"                       # a LoRA adapter's name (docs/lora.md); absent = the base model
LORA_ADMIN = "lora_admin"           # a control request to the engine: JSON {"action": "load" | "unload",
                                    # "lora_name", "lora_path"} (backend/serving/lora_control.py)
# Prefill/decode disaggregation (docs/disaggregation.md): a prefill engine ends a request it hands
# over with finish_reason FINISH_HANDOVER and no tokens; the record (backend/disagg/handover.py, JSON
# text) rides under key HANDOVER in that final response's METRICS JSON, which every ensemble step
# passes through unchanged (PASS_THROUGH). The front sends the continuation -- the same request plus
# parameter HANDOVER = the record -- to a decode engine, which streams from the first token.
HANDOVER = "handover"
FINISH_HANDOVER = "handover"
TEST_FAULT = "test_fault"           # tests only: engine option test_faults + TRITON_LLM_TEST_FAULTS=1
MAX_TENANT_CHARS = 256
# Structured outputs (backend/structured/spec.py): JSON values as JSON text.
RESPONSE_FORMAT = "response_format"       # OpenAI: {"type": "json_object" | "json_schema", ...}
GUIDED_JSON = "guided_json"               # vLLM's names, for direct Triton clients
GUIDED_REGEX = "guided_regex"
GUIDED_CHOICE = "guided_choice"
GUIDED_GRAMMAR = "guided_grammar"
TOOLS = "tools"                           # OpenAI tools (also rendered by the chat template)
TOOL_CHOICE = "tool_choice"               # "none" | "auto" | "required" | {"type": "function", ...}
PARALLEL_TOOL_CALLS = "parallel_tool_calls"
LOGIT_BIAS = "logit_bias"                 # {"token id": bias in [-100, 100]}
# Embedding requests (engine model, token ids in; docs/openai_api.md): parameter EMBED = true makes
# the request an embedding one, answered by one final response whose EMBEDDING output is the vector.
EMBED = "embed"
DIMENSIONS = "dimensions"                 # Matryoshka models only (backend/model/pooling.py)
NORMALIZE = "normalize"                   # L2-normalize (default: the model's, on unless its config says)
STRUCTURED_PARAMS = (RESPONSE_FORMAT, GUIDED_JSON, GUIDED_REGEX, GUIDED_CHOICE, GUIDED_GRAMMAR, TOOLS,
                     TOOL_CHOICE, PARALLEL_TOOL_CALLS)
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

INT_PARAMS = (N, MAX_TOKENS, MIN_TOKENS, TOP_K, SEED, TOP_LOGPROBS, REQUEST_PRIORITY)
FLOAT_PARAMS = (TEMPERATURE, TOP_P, MIN_P, PRESENCE_PENALTY, FREQUENCY_PENALTY, REPETITION_PENALTY,
                REQUEST_TIMEOUT)
BOOL_PARAMS = (STREAM, IGNORE_EOS, SKIP_SPECIAL_TOKENS, SPECULATIVE)
LIST_PARAMS = (STOP, STOP_TOKEN_IDS)
# SamplingParams fields set from request parameters of the same name (logprobs is derived).
SAMPLING_PARAMS = (N, MAX_TOKENS, MIN_TOKENS, TEMPERATURE, TOP_P, TOP_K, MIN_P, SEED, PRESENCE_PENALTY,
                   FREQUENCY_PENALTY, REPETITION_PENALTY, STOP, STOP_TOKEN_IDS, IGNORE_EOS,
                   SKIP_SPECIAL_TOKENS, SPECULATIVE)
# Names a client may use that Triton's gRPC front end would consume: sent under the right name.
RENAMED_PARAMS = {"priority": REQUEST_PRIORITY, "timeout": REQUEST_TIMEOUT}
# Reserved by Triton's gRPC front end (tritonclient refuses them or they never reach a model).
RESERVED_PARAMS = ("sequence_id", "sequence_start", "sequence_end", "headers", "binary_data_output")
