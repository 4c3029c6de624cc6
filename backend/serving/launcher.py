"""The launcher's public entry points, one import for callers (cli, tests, load harness).

    process_group.py   free_port, terminate_group: children in their own process group
    server_log.py      what a failed start's log says
    tritonserver.py    TritonServer (start / drain / stop one server), ServerStartError
    serve.py           serve_main (``triton-llm serve``: server + shim, supervised), start_shim
"""
from __future__ import annotations

from backend.serving.process_group import free_port, terminate_group
from backend.serving.serve import SERVE_DRAIN_SECONDS, serve_main, start_shim
from backend.serving.server_log import failure_report, log_errors, log_tail
from backend.serving.tritonserver import ADMIN_HEADER, ServerStartError, TritonServer

__all__ = ["ADMIN_HEADER", "SERVE_DRAIN_SECONDS", "ServerStartError", "TritonServer", "failure_report",
           "free_port", "log_errors", "log_tail", "serve_main", "start_shim", "terminate_group"]
