"""Running requests from synchronous code, for backends' `run`: on a fresh loop (`run_sync`,
the default of `RolloutBase.run`), or on a loop in a thread of its own (`start_thread`).
flowrl's own engine makes its model calls on the caller's thread while its requests' event loop
runs on a helper thread (engines/hf/scheduler.py); SGLang answers on the loop its tokenizer
manager runs on (engines/sglang/backend.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


def run_sync(coroutine):
    """Run a coroutine to its end from synchronous code, also where an event loop already
    runs in this thread (then in a thread of its own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    return start_thread(coroutine)()


def start_thread(coroutine, finished: Callable[[], None] | None = None) -> Callable[[], Any]:
    """Start `coroutine` on a fresh event loop in a thread of its own; `finished()` runs in
    that thread once the coroutine has ended. Returns `join`: waits, then returns the
    coroutine's value or raises its error in the caller's thread."""
    out = {}

    def target():
        try:
            out["value"] = asyncio.run(coroutine)
        except BaseException as e:  # re-raised by join, in the caller's thread
            out["error"] = e
        finally:
            if finished is not None:
                finished()

    thread = threading.Thread(target=target, name="flowrl-requests", daemon=True)
    thread.start()

    def join():
        thread.join()
        if "error" in out:
            raise out["error"]
        return out["value"]

    return join
