"""Triton adapter: engine token windows -> text deltas (backend/serving/postprocess.py does the work)."""

import numpy as np
import triton_python_backend_utils as pb_utils

from backend import protocol as P
from backend.serving.errors import as_engine_error, to_wire, triton_code
from backend.serving.postprocess import Postprocessor, string_array
from backend.serving.preprocess import one_string
from backend.serving.preprocess import parse_parameters, read
from backend.serving.stub_exit import exit_stub
from backend.serving.adapter_config import config_parameters, require_model_dir


def _np(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy()


def _int(request, name):
    return int(_np(request, name).reshape(-1)[0])


class TritonPythonModel:
    def initialize(self, args):
        params = config_parameters(args["model_config"])
        self.post = Postprocessor(require_model_dir(params.get(P.MODEL_DIR, "")))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                finish = one_string(_np(request, P.FINISH_REASON), P.FINISH_REASON) or ""
                text = self.post.text([int(t) for t in _np(request, P.WINDOW_IDS).reshape(-1)],
                                      _int(request, P.NUM_SENT), _int(request, P.MAX_CHARS), finish,
                                      skip_special_tokens=read(parse_parameters(request.parameters()),
                                                               P.SKIP_SPECIAL_TOKENS, True))
                logprobs = self.post.logprobs(one_string(_np(request, P.LOGPROBS), P.LOGPROBS) or "")
                outputs = [pb_utils.Tensor(P.TEXT_OUTPUT, string_array(text)),
                           pb_utils.Tensor(P.FINISH_REASON, string_array(finish)),
                           pb_utils.Tensor(P.LOGPROBS, string_array(logprobs))]
                outputs += [pb_utils.Tensor(name, np.ascontiguousarray(_np(request, name))) for name in P.PASS_THROUGH]
                responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
            except Exception as exc:
                err = as_engine_error(exc)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
                    to_wire(err), getattr(pb_utils.TritonError, triton_code(err)))))
        return responses

    def finalize(self):
        exit_stub()               # the stub's own teardown is slow and not needed (stub_exit.py)
