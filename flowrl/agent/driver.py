"""The wave driver: every request of a batch advances one assistant turn at a time, in lockstep.

    start every request's tools
    while requests are active:
        one turn for all of them on the engine (it appends each row's observation first)
        each request parses its turn; those that called run their tools, all concurrently
        requests that ended leave; the rest go on with their observation ids

Lockstep keeps a batched engine busy (a decode step costs about the same for 8 rows as for 32)
and makes the rollout a function of the seed and the tools' answers, so `--resume` samples
the same trajectories when the tools are deterministic. Decode and tools alternate, so on a
small CPU machine they never compete for cores.

The engine is anything with `turn(rows, append, limits) -> [(ids, logprobs)]` (a
`TurnBackend`): flowrl/engines/wave_rollout.py, or a script of ids in tests. No torch here.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Protocol

import attrs


class TurnBackend(Protocol):
    def turn(
        self, rows: list[int], append: list[list[int]], limits: list[int]
    ) -> list[tuple[list[int], list[float]]]:
        """Sample one assistant turn for each of `rows` (request indices, ascending; a
        request absent from `rows` has ended for good), after appending `append[k]` to row
        k's sequence, at most `limits[k]` tokens each, stopping at eos: (ids, log-probs)."""
        ...


@attrs.define
class WaveStats:
    waves: int = 0
    decode_s: float = 0.0  # wall time inside the engine
    tools_s: float = 0.0  # wall time running tools and interactions
    phases: list = attrs.Factory(list)  # ("decode" | "tools", start, end) in epoch seconds

    def add(self, kind: str, start: float) -> None:
        """Record a phase that began at `start` (time.time()) and ends now."""
        end = time.time()
        self.phases.append((kind, start, end))
        if kind == "decode":
            self.decode_s += end - start
        else:
            self.tools_s += end - start


async def run_waves(episodes: list, backend: TurnBackend) -> WaveStats:
    """Run `episodes` (episode.Episode) to the end on `backend`; nothing a request does
    raises here, only the engine's own errors do."""
    stats = WaveStats()
    start = time.time()
    await asyncio.gather(*(episode.start() for episode in episodes))
    stats.add("tools", start)
    active = [i for i, episode in enumerate(episodes) if not episode.done]
    append = {i: [] for i in active}
    while active:
        stats.waves += 1
        start = time.time()
        limits = [episodes[i].turn_limit() for i in active]
        turns = backend.turn(active, [append[i] for i in active], limits)
        stats.add("decode", start)
        for i, (ids, logprobs) in zip(active, turns, strict=True):
            episodes[i].on_turn(ids, logprobs)
        start = time.time()
        waiting = [i for i in active if not episodes[i].done]
        observations = await asyncio.gather(*(episodes[i].advance() for i in waiting))
        append = dict(zip(waiting, observations, strict=True))
        active = [i for i in waiting if not episodes[i].done]
        if waiting:
            stats.add("tools", start)
    start = time.time()
    await asyncio.gather(*(episode.finish() for episode in episodes))
    stats.add("tools", start)
    return stats


def run_sync(coroutine):
    """Run a coroutine to its end from synchronous code, also where an event loop already
    runs in this thread (then in a thread of its own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    out = {}

    def target():
        try:
            out["value"] = asyncio.run(coroutine)
        except BaseException as e:  # re-raised in the caller's thread
            out["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
