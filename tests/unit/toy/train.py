"""Toy policy update: responses, advantages, old_logprobs -> (update)."""

import attrs

from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    mini_batch_size: int = 0
    epochs: int = 1


class TrainWorker:
    def __init__(self, engine, params):
        self.params = params


SPEC = NodeSpec(
    reads=("responses", "advantages", "old_logprobs"),
    writes=(),
    params=Params,
    worker=TrainWorker,
    mode="train",
    head="lm",
)
