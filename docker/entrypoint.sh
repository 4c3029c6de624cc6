#!/usr/bin/env bash
# Container entrypoint: the project's launcher (tritonserver on the generated model repository,
# the engine inside it, and optionally the OpenAI shim), configured from environment variables.
#
#   MODEL_DIR        Hugging Face checkpoint directory (a mounted volume)       /models/model
#   MODEL_PRESET     if MODEL_DIR has no config.json, make this preset there    (unset: fail)
#   HOST             address of an in-container shim (loopback outside a container)  0.0.0.0
#   EXPOSE_TRITON    1: Triton's ports bind HOST too (they have no API keys); else loopback
#   HTTP_PORT / GRPC_PORT / METRICS_PORT                                        8000 / 8001 / 8002
#   SHIM_PORT        OpenAI shim in this container (0 = run it as its own service)  0
#   ENGINE_OPTIONS   space-separated KEY=VALUE engine options (backend/config.py EngineArgs)
#   API_KEYS_FILE    API keys for an in-container shim (KEY[:TENANT] per line; or env
#                    TRITON_LLM_API_KEYS); with SHIM_PORT set and no keys it refuses to start
#   INSECURE_NO_API_KEYS  1: run an in-container shim without API keys anyway
#   WORKDIR          generated model repository and logs                        /tmp/triton-llm
#
# `exec` makes the launcher the child of the init process (tini, or compose `init: true`), so
# SIGTERM reaches it and it drains before exiting.
set -euo pipefail

if [ "$#" -gt 0 ]; then
  exec "$@"
fi

MODEL_DIR=${MODEL_DIR:-/models/model}
if [ ! -f "$MODEL_DIR/config.json" ]; then
  if [ -n "${MODEL_PRESET:-}" ]; then
    echo "[entrypoint] $MODEL_DIR has no config.json: making preset $MODEL_PRESET there"
    triton-llm make-model "$MODEL_PRESET" --out "$MODEL_DIR"
  else
    echo "[entrypoint] $MODEL_DIR has no config.json; mount a checkpoint there or set MODEL_PRESET" >&2
    exit 2
  fi
fi

args=(serve --model "$MODEL_DIR" --host "${HOST:-0.0.0.0}"
      --http-port "${HTTP_PORT:-8000}" --grpc-port "${GRPC_PORT:-8001}"
      --metrics-port "${METRICS_PORT:-8002}" --shim-port "${SHIM_PORT:-0}"
      --workdir "${WORKDIR:-/tmp/triton-llm}")
if [ "${EXPOSE_TRITON:-0}" = "1" ]; then
  args+=(--expose-triton)       # compose: the separate shim service reaches triton:8001
fi
for opt in ${ENGINE_OPTIONS:-}; do
  args+=(--engine-option "$opt")
done
if [ -n "${API_KEYS_FILE:-}" ]; then
  args+=(--api-keys "$API_KEYS_FILE")
elif [ "${SHIM_PORT:-0}" != "0" ] && [ -z "${TRITON_LLM_API_KEYS:-}" ] \
     && [ "${INSECURE_NO_API_KEYS:-0}" != "1" ]; then
  # A shim in a container is meant to be reached from outside: never open by accident.
  echo "[entrypoint] SHIM_PORT is set but no API keys are: set API_KEYS_FILE or TRITON_LLM_API_KEYS" \
       "(KEY[:TENANT],...), or INSECURE_NO_API_KEYS=1 to serve without authentication" >&2
  exit 2
elif [ "${INSECURE_NO_API_KEYS:-0}" = "1" ]; then
  export TRITON_LLM_INSECURE_NO_API_KEYS=1   # the shim refuses an open non-loopback host otherwise
fi
echo "[entrypoint] triton-llm ${args[*]}"
exec triton-llm "${args[@]}"
