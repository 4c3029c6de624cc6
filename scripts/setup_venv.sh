#!/usr/bin/env bash
# Create the project venv from nothing: torch pinned first (CPU build), then the pinned rest,
# then the project itself (editable) so the Triton Python-backend stub imports it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.installed-$(cat requirements.txt pyproject.toml | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/python -c 'import torch' 2>/dev/null || .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -r requirements.txt
  .venv/bin/pip install -q --no-deps -e .
  rm -f .venv/.installed-*
  touch "$stamp"
fi
