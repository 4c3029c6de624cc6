"""The e2e tests use the session-scoped ``triton_server`` fixture from tests/conftest.py
(shared with tests/browser, so one full run starts one server for both)."""
