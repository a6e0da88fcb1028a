"""Run a tool's code where nothing it does can stall the rollout or outlive the run.

Each call (a function tool, a verl tool's `create` / `execute` / `calc_reward` / `release`,
an interaction's reply) runs in a daemon thread of its own; an `async def` runs there on an
event loop of its own. So an async tool that blocks (the usual shape of a verl `execute` doing
I/O with a blocking client) stalls only its own loop, and its timeout holds: the rank's loop
waits on a future, never on the tool. A call past its timeout is abandoned: its thread cannot
be killed, but it is a daemon, so it never keeps the process alive at exit (a
concurrent.futures pool's threads are joined at exit: a never-returning tool kept `flowrl run`
alive forever). Once a tool has a call running past its timeout, it is started only while its
abandoned calls and its calls in flight number fewer than `MAX_STUCK` (a call in flight may
hang too), so a hung tool leaks at most `MAX_STUCK` threads after its first wave; a tool
whose calls all return is never limited.

No torch.
"""

from __future__ import annotations

import asyncio
import inspect
import threading

MAX_STUCK = 4  # abandoned calls of one tool still running; more are refused, not started
_STUCK: dict[str, list[threading.Thread]] = {}  # tool name -> its abandoned, live threads
_IN_FLIGHT: dict[str, int] = {}  # tool name -> its calls started and not yet returned or abandoned
_LOCK = threading.Lock()


class ToolStuck(TimeoutError):
    """A tool whose earlier calls are still running past their timeout."""


def stuck_threads(name: str | None = None) -> int:
    """Live threads of abandoned calls (of one tool, or of all)."""
    with _LOCK:
        return _stuck(name)


def _stuck(name: str | None) -> int:
    """`stuck_threads`, with the lock held."""
    for key in list(_STUCK):
        _STUCK[key] = [t for t in _STUCK[key] if t.is_alive()]
    if name is not None:
        return len(_STUCK.get(name, []))
    return sum(len(threads) for threads in _STUCK.values())


async def run_call(name: str, function, kwargs: dict, timeout: float):
    """`function(**kwargs)` (sync or async, or returning an awaitable) in a daemon thread,
    awaited for at most `timeout` seconds. Raises what the call raised, TimeoutError past the
    timeout, or ToolStuck when `name` has MAX_STUCK abandoned calls still running."""
    with _LOCK:  # checked and counted at once: concurrent calls cannot all slip past the limit
        stuck = _stuck(name)
        if stuck and stuck + _IN_FLIGHT.get(name, 0) >= MAX_STUCK:
            raise ToolStuck(
                f"{name} has {stuck} calls still running past their timeout (and "
                f"{_IN_FLIGHT.get(name, 0)} in flight, which may hang too); not started"
            )
        _IN_FLIGHT[name] = _IN_FLIGHT.get(name, 0) + 1
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def deliver(value, error) -> None:
        if future.done():  # abandoned: the caller timed out
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def target() -> None:
        value, error = None, None
        try:
            value = function(**kwargs)
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))  # a loop of this thread's own
        except BaseException as e:  # handed to the caller, raised there
            error = e
        try:
            loop.call_soon_threadsafe(deliver, value, error)
        except RuntimeError:  # the rollout's loop has closed: nobody waits any more
            pass

    thread = threading.Thread(target=target, name=f"flowrl-tool:{name}", daemon=True)
    try:
        thread.start()
        return await asyncio.wait_for(future, timeout)
    except TimeoutError:
        with _LOCK:
            _STUCK.setdefault(name, []).append(thread)
        raise
    finally:
        with _LOCK:  # returned, raised or abandoned (then counted as stuck): no longer in flight
            _IN_FLIGHT[name] -= 1


async def _awaited(awaitable):
    return await awaitable
