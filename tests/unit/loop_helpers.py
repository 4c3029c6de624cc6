"""Counting the Python calls an awaited request makes on the event loop's thread (the chat tests'
measure of work that blocks the loop: a count, not a time, so it does not race the CPU)."""
from __future__ import annotations

import sys


async def loop_calls(request):
    """(Python calls made on this thread while ``await request()`` runs, its result)."""
    n = [0]

    def profile(frame, event, arg):
        if event == "call":
            n[0] += 1

    sys.setprofile(profile)
    try:
        r = await request()
    finally:
        sys.setprofile(None)
    return n[0], r
