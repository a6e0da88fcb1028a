"""Every call to the endpoint, recorded per episode, and an episode's calls as training rows.

A call is what the model saw and did: the prompt ids (the chat template of the messages the
agent sent, applied on the server), the completion ids the engine sampled, each one's log-prob
and the policy version that sampled it. Rows are made from the ids, never from text.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import attrs


@attrs.frozen
class Call:
    prompt_ids: tuple[int, ...] = attrs.field(converter=tuple)
    completion_ids: tuple[int, ...] = attrs.field(converter=tuple)
    logprobs: tuple[float, ...] = attrs.field(converter=tuple)
    version: int = 0  # the policy version (weight syncs so far) that sampled it
    finish_reason: str = "stop"


class Recorder:
    """The calls of each episode, in the order they finished."""

    def __init__(self):
        self.calls: dict[str, list[Call]] = defaultdict(list)
        self.lock = threading.Lock()

    def add(
        self, episode: str, prompt_ids, completion_ids, logprobs, version: int, reason: str
    ) -> None:
        call = Call(prompt_ids, completion_ids, logprobs, version, reason)
        with self.lock:
            self.calls[episode].append(call)

    def take(self, episode: str) -> list[Call]:
        """The episode's calls, forgotten here."""
        with self.lock:
            return self.calls.pop(episode, [])


@attrs.define
class Segment:
    """One training row of an episode: the prompt the model saw at the segment's first call,
    then every call's completion (trained, mask 1) and what the next prompt added between
    them (tool output, a user turn, the template's glue: attended to, mask 0)."""

    prompt_ids: list[int]
    ids: list[int] = attrs.field(factory=list)
    mask: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    versions: list[int] = attrs.field(factory=list)  # each call's policy version
    calls: int = 0

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.ids

    def extend(self, call: Call, delta: list[int]) -> None:
        self.ids += delta + list(call.completion_ids)
        self.mask += [0] * len(delta) + [1] * len(call.completion_ids)
        self.logprobs += [0.0] * len(delta) + list(call.logprobs)
        self.versions.append(call.version)
        self.calls += 1


def segments(calls: list[Call]) -> list[Segment]:
    """An episode's calls as training rows, from their token ids alone.

    A call whose prompt starts with everything the current segment holds (its prompt, the
    completions and what came between) extends it: the tokens between are the delta, mask 0.
    Any other call starts a new segment: the agent rewrote the history (dropped or edited a
    message), or the chat template renders an earlier turn otherwise than the model sampled
    it (re-tokenized text, a tool call shown differently, a reasoning block dropped). Each
    segment trains on exactly the tokens the model saw when it sampled them.
    """
    out: list[Segment] = []
    for call in calls:
        prompt = list(call.prompt_ids)
        if out:
            context = out[-1].context
            if prompt[: len(context)] == context:
                out[-1].extend(call, prompt[len(context) :])
                continue
        out.append(Segment(prompt))
        out[-1].extend(call, [])
    return out


def broadcast(per_episode: list[float], counts: list[int]) -> list[float]:
    """Per-row values of per-episode ones (a score, an advantage): episode k's value for each
    of its `counts[k]` segments. Group statistics (GRPO's mean and std) are taken over
    episodes first, then broadcast, so an episode split in three is not counted three times."""
    return [v for v, c in zip(per_episode, counts, strict=True) for _ in range(c)]
