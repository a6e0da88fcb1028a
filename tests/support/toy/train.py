"""Toy policy update: responses, advantages, old_logprobs (+ ref_logprobs when kl_coef > 0)
-> (update)."""

import attrs

from flowrl.hooks import MINI_BATCHES
from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    mini_batch_size: int = 0
    epochs: int = 1
    kl_coef: float = 0.1


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
    optional_reads={"ref_logprobs": lambda p: p.kl_coef > 0},
    check=MINI_BATCHES.check,
    updates_per_step=MINI_BATCHES.updates,
)
