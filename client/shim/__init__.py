"""OpenAI-compatible HTTP shim over the Triton ``llm`` ensemble (FastAPI + uvicorn)."""
from client.shim.app import create_app
from client.shim.settings import ShimSettings

__all__ = ["create_app", "ShimSettings", "main"]


def main(argv: list[str] | None = None) -> int:
    from client.shim.__main__ import main as _main

    return _main(argv)
