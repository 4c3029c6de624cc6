"""Triton adapter of the decoupled engine model (the work is in backend/serving/engine_service.py).

execute() copies each request out of pb_utils and hands it to the EngineService, which submits it
to the EngineLoop thread and answers from its own response thread; execute() returns None at once.
"""
import sys

import gc
import logging

import triton_python_backend_utils as pb_utils

from backend import protocol as P
from backend.serving.engine_service import STUB_SWITCH_INTERVAL_S, Incoming, build_engine_service
from backend.serving.errors import to_wire, triton_code
from backend.serving.stub_exit import exit_stub
from backend.serving.adapter_config import config_parameters, require_model_dir

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class Responder:
    """backend.serving.engine_service.Responder over a pb_utils ResponseSender."""
    __slots__ = ("sender",)

    def __init__(self, sender):
        self.sender = sender

    def send(self, outputs=None, *, error=None, final=False):
        flags = FINAL if final else 0
        if outputs is None and error is None:
            self.sender.send(flags=flags)
            return
        tensors = [pb_utils.Tensor(name, value) for name, value in (outputs or {}).items()]
        err = None
        if error is not None:
            err = pb_utils.TritonError(to_wire(error), getattr(pb_utils.TritonError, triton_code(error)))
        self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors, error=err), flags=flags)

    def is_cancelled(self):
        return self.sender.is_cancelled()


class MetricFactory:
    """backend.serving.metrics factory over pb_utils.MetricFamily (one family per name)."""

    def __init__(self):
        self.families = {}

    def _family(self, name, doc, kind):
        if name not in self.families:
            self.families[name] = pb_utils.MetricFamily(name=name, description=doc, kind=kind)
        return self.families[name]

    def counter(self, name, doc, labels):
        return self._family(name, doc, pb_utils.MetricFamily.COUNTER).Metric(labels=labels)

    def gauge(self, name, doc, labels):
        return self._family(name, doc, pb_utils.MetricFamily.GAUGE).Metric(labels=labels)

    def histogram(self, name, doc, labels, buckets):
        return self._family(name, doc, pb_utils.MetricFamily.HISTOGRAM).Metric(labels=labels, buckets=buckets)


class TritonLogHandler(logging.Handler):
    """Python logging -> tritonserver's log (pb_utils.Logger), for the model-loading logger: the
    startup line with the dtype, quantization and weight bytes lands in tritonserver.log."""

    def emit(self, record):
        msg = f"{record.name}: {record.getMessage()}"
        (pb_utils.Logger.log_warn if record.levelno >= logging.WARNING else pb_utils.Logger.log_info)(msg)


def _forward_model_log():
    log = logging.getLogger("triton_llm.model")
    if not any(isinstance(h, TritonLogHandler) for h in log.handlers):
        log.addHandler(TritonLogHandler())
        log.setLevel(logging.INFO)


class TritonPythonModel:
    def initialize(self, args):
        _forward_model_log()
        if not pb_utils.using_decoupled_model_transaction_policy(self._config(args)):
            raise ValueError("the engine model must be decoupled (model_transaction_policy { decoupled: true })")
        params = config_parameters(args["model_config"])
        model_dir = require_model_dir(params.get(P.MODEL_DIR, ""))
        labels = {"model": args["model_name"], "version": args["model_version"]}
        # Metric objects must not outlive their families: keep the factory (and its families) here.
        self.metric_factory = MetricFactory()
        self.service = build_engine_service(str(model_dir), params, metrics_factory=self.metric_factory,
                                            labels=labels)
        self.max_input = self.service.intake.max_model_len
        # Everything loaded so far (torch, transformers, the model) lives as long as this process:
        # out of the collector's sight, a full collection costs ~1 ms instead of ~100 ms (one
        # stalled step for every running stream, about every 20 s under load; disaggregation
        # bench, docs/benchmarks.md).
        gc.collect()
        gc.freeze()
        # The engine thread gets the GIL back promptly after each C call (see the constant).
        sys.setswitchinterval(STUB_SWITCH_INTERVAL_S)

    @staticmethod
    def _config(args):
        import json
        return json.loads(args["model_config"])

    def execute(self, requests):
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, P.INPUT_IDS)
            ids, oversize = None, 0
            if tensor is not None:
                arr = tensor.as_numpy().reshape(-1)
                if arr.size > self.max_input:       # never build a huge list: reject by length
                    oversize = int(arr.size)
                else:
                    ids = arr.tolist()
            timeout_us = request.timeout() if hasattr(request, "timeout") else 0
            wanted = request.requested_output_names() if hasattr(request, "requested_output_names") else None
            self.service.submit(Incoming(
                request_id=request.request_id(), input_ids=ids, parameters=request.parameters(),
                responder=Responder(request.get_response_sender()),
                timeout_s=timeout_us / 1e6 if timeout_us else None, oversize=oversize,
                requested_outputs=frozenset(wanted) if wanted else None))
        return None

    def finalize(self):
        try:
            self.service.shutdown()
        finally:
            exit_stub()           # the stub's own teardown is slow and not needed (stub_exit.py)
