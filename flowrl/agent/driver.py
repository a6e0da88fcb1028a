"""The request driver: every request of a rollout is its own asyncio task over the rollout
contract (flowrl/engines/rollout.py), with no barrier between requests.

    per request, concurrently with all the others:
        start its tools
        while it has not ended:
            one turn: await backend.generate(its whole conversation, kept by its id)
            parse the turn; run its calls (or the interaction)
        release what the backend holds for it; finish its tools

A request whose tools answer early goes on decoding while others wait for theirs; a batching
backend puts every request that is decoding into the same model call, so the engine stays
busy while tools run. The state machine (episode.py) is unchanged: the driver feeds it the
sampled ids and appends what it returns.

Reproducibility: each request samples from its own stream, seeded by (seed, turn), so its
tokens do not depend on which requests share a batch beyond floating-point noise. For bit-exact
runs, a backend in lockstep (flowrl's `hf`, `lockstep = True`) batches as a function of the
requests alone; the driver then starts every request's tools before the first turn, so the
first turns arrive together.

The backend is anything with `async generate(Request) -> Result` and `release(id)`. No torch.
"""

from __future__ import annotations

import asyncio
import time

import attrs

from flowrl.engines.rollout import Request, Sampling
from flowrl.errors import InfraError

DEFAULT_SAMPLING = Sampling()


@attrs.define
class RolloutStats:
    """Wall-clock spans of a rollout: per request ("decode" | "tools", start, end), in epoch
    seconds; `phases` merges them per kind into the spans where any request was there."""

    turns: int = 0  # generate calls
    spans: list = attrs.Factory(list)

    def add(self, kind: str, start: float) -> None:
        self.spans.append((kind, start, time.time()))

    @property
    def phases(self) -> list[tuple[str, float, float]]:
        """The union of each kind's spans: ("decode" | "tools", start, end), by start."""
        out = []
        for kind in ("decode", "tools"):
            out += [(kind, a, b) for a, b in _union([s[1:] for s in self.spans if s[0] == kind])]
        return sorted(out, key=lambda p: (p[1], p[0]))

    def seconds(self, kind: str) -> float:
        return sum(b - a for k, a, b in self.phases if k == kind)

    @property
    def overlap_s(self) -> float:
        """Seconds in which some request decoded while another ran tools."""
        decode = [(a, b) for k, a, b in self.phases if k == "decode"]
        tools = [(a, b) for k, a, b in self.phases if k == "tools"]
        return sum(max(0.0, min(b, d) - max(a, c)) for a, b in decode for c, d in tools)


async def run_requests(
    episodes: list,
    backend,
    sampling: Sampling = DEFAULT_SAMPLING,
    seeds: list[int] | None = None,
    first_turn: list[int] = (),
    lockstep: bool = False,
) -> RolloutStats:
    """Run `episodes` (episode.Episode) to the end on `backend`, each its own task. `seeds`:
    each request's seed (default: its index); `first_turn`: ids every request's first turn is
    made of (the agent's script_first_turn). Nothing a request does raises here, only the
    backend's own errors do."""
    stats = RolloutStats()
    seeds = list(range(len(episodes))) if seeds is None else seeds
    for episode, seed in zip(episodes, seeds, strict=True):
        episode.seed = seed  # an environment resets with its request's seed
    if lockstep:  # the first turns reach the engine in one loop iteration, together
        start = time.time()
        await asyncio.gather(*(episode.start() for episode in episodes))
        stats.add("tools", start)
    tasks = [
        _request(e, backend, sampling, seed, list(first_turn), stats, started=lockstep)
        for e, seed in zip(episodes, seeds, strict=True)
    ]
    await asyncio.gather(*tasks)
    return stats


async def _request(episode, backend, sampling, seed, first_turn, stats, started) -> None:
    if not started:
        start = time.time()
        await episode.start()
        stats.add("tools", start)
    turn = 0
    try:
        while not episode.done:
            request = Request(
                episode.prompt_ids + episode.ids,
                episode.turn_limit(),
                sampling,
                request_id=episode.request_id,
                keep=True,
                seed=seed,
                turn=turn,
                forced=first_turn if turn == 0 else (),
            )
            start = time.time()
            result = await backend.generate(request)
            stats.add("decode", start)
            stats.turns += 1
            if result.finish_reason == "abort":  # cut short: not a turn the policy ended
                episode.fail(InfraError("the rollout backend aborted the request"))
                break
            episode.on_turn(result.ids, result.logprobs)
            if episode.done:
                break
            start = time.time()
            await episode.advance()
            stats.add("tools", start)
            turn += 1
    finally:
        backend.release(episode.request_id)
    start = time.time()
    await episode.finish()
    stats.add("tools", start)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]
