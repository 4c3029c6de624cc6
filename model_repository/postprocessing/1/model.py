"""Triton adapter: engine token windows -> text deltas (backend/serving/postprocess.py does the work)."""
import numpy as np
import triton_python_backend_utils as pb_utils

from backend.serving.errors import tagged
from backend.serving.postprocess import Postprocessor
from backend.serving.request_params import parse_parameters
from backend.serving.tensors import config_parameters, one_string, require_model_dir, string_array

PASS_THROUGH = ("output_ids", "index", "prompt_tokens", "completion_tokens", "cached_tokens", "metrics")


def _np(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy()


def _skip_special(request):
    value = parse_parameters(request.parameters()).get("skip_special_tokens", True)
    return value if isinstance(value, bool) else str(value).lower() not in ("false", "0", "no")


class TritonPythonModel:
    def initialize(self, args):
        params = config_parameters(args["model_config"])
        self.post = Postprocessor(require_model_dir(params.get("model_dir", "")))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                finish = one_string(_np(request, "finish_reason"), "finish_reason") or ""
                text = self.post.text([int(t) for t in _np(request, "window_ids").reshape(-1)],
                                      int(_np(request, "num_sent").reshape(-1)[0]),
                                      int(_np(request, "max_chars").reshape(-1)[0]), finish,
                                      skip_special_tokens=_skip_special(request))
                logprobs = self.post.logprobs(one_string(_np(request, "logprobs"), "logprobs") or "")
                outputs = [pb_utils.Tensor("text_output", string_array(text)),
                           pb_utils.Tensor("finish_reason", string_array(finish)),
                           pb_utils.Tensor("logprobs", string_array(logprobs))]
                outputs += [pb_utils.Tensor(name, np.ascontiguousarray(_np(request, name))) for name in PASS_THROUGH]
                responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
            except Exception as exc:
                err = tagged(exc)
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError(str(err), pb_utils.TritonError.INTERNAL)))
        return responses
