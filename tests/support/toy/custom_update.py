"""A user's train node in its own file, whose params are not called epochs / mini_batch_size:
it declares them to MiniBatches and gets the built-in checks and schedule arithmetic."""

import attrs

from flowrl.hooks import MiniBatches
from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    passes: int = 1  # passes over the step's rows
    minibatch: int = 0  # rows per optimizer step; 0 = the whole batch


class UpdateWorker:
    def __init__(self, engine, params):
        self.params = params


batching = MiniBatches(epochs="passes", size="minibatch")

SPEC = NodeSpec(
    reads=("responses", "advantages"),
    writes=(),
    params=Params,
    worker=UpdateWorker,
    mode="train",
    head="lm",
    check=batching.check,
    updates_per_step=batching.updates,
)
