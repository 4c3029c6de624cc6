"""Errors the engine raises synchronously at admission (the serving layer maps them to 429 / 400)."""
from __future__ import annotations


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full; try again after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(f"[queue_full retry_after={retry_after:g}] {message}")
        self.retry_after = retry_after
