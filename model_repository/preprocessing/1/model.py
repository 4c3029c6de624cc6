"""Triton adapter: prompt / chat messages -> input_ids (backend/serving/preprocess.py does the work)."""
import numpy as np
import triton_python_backend_utils as pb_utils

from backend.serving.errors import tagged
from backend.serving.preprocess import Preprocessor
from backend.serving.request_params import parse_parameters
from backend.serving.tensors import config_parameters, int_array, one_string, require_model_dir

ERROR_CODES = {"invalid_request": "INVALID_ARG", "queue_full": "UNAVAILABLE", "unavailable": "UNAVAILABLE",
               "internal": "INTERNAL"}


def _input(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def error_response(exc):
    err = tagged(exc)
    code = getattr(pb_utils.TritonError, ERROR_CODES.get(err.kind, "INTERNAL"))
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(err), code))


class TritonPythonModel:
    def initialize(self, args):
        params = config_parameters(args["model_config"])
        model_dir = require_model_dir(params.get("model_dir", ""))
        max_len = int(params.get("max_model_len") or 0) or None
        self.pre = Preprocessor(model_dir, max_len)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                text = one_string(_input(request, "text_input"), "text_input")
                messages = one_string(_input(request, "messages"), "messages")
                ids, _ = self.pre(text, messages, parse_parameters(request.parameters()))
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("input_ids", int_array(ids))]))
            except Exception as exc:
                responses.append(error_response(exc))
        return responses
