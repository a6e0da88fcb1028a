"""Toy log-prob node: responses -> logprobs."""

import attrs

from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    temperature: float = 1.0


class LogprobWorker:
    def __init__(self, engine, params):
        self.params = params


SPEC = NodeSpec(
    reads=("responses", "response_mask"),
    writes=("logprobs",),
    params=Params,
    worker=LogprobWorker,
    mode="inference",
    head="lm",
)
