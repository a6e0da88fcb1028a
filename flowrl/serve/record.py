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
