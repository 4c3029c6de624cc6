"""Triton adapter: prompt / chat messages -> input_ids (backend/serving/preprocess.py does the work)."""

import triton_python_backend_utils as pb_utils

from backend import protocol as P
from backend.serving.errors import as_engine_error, to_wire, triton_code
from backend.serving.preprocess import Preprocessor, int_array, one_string
from backend.serving.preprocess import parse_parameters
from backend.serving.stub_exit import exit_stub
from backend.serving.adapter_config import config_parameters, require_model_dir


def _input(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def error_response(exc):
    err = as_engine_error(exc)
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
        to_wire(err), getattr(pb_utils.TritonError, triton_code(err))))


class TritonPythonModel:
    def initialize(self, args):
        params = config_parameters(args["model_config"])
        model_dir = require_model_dir(params.get(P.MODEL_DIR, ""))
        self.pre = Preprocessor(model_dir, int(params.get(P.CONTEXT_WINDOW) or 0) or None)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                text = one_string(_input(request, P.TEXT_INPUT), P.TEXT_INPUT)
                messages = one_string(_input(request, P.MESSAGES), P.MESSAGES)
                ids = self.pre(text, messages, parse_parameters(request.parameters()))
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(P.INPUT_IDS, int_array(ids))]))
            except Exception as exc:
                responses.append(error_response(exc))
        return responses

    def finalize(self):
        exit_stub()               # the stub's own teardown is slow and not needed (stub_exit.py)
