"""Toy rollout node for compiler tests: prompts -> responses (n per prompt)."""

import attrs

from flowrl.nodespec import NodeSpec, RolloutParams


@attrs.frozen
class Params(RolloutParams):
    max_new_tokens: int = 8


class GenWorker:
    def __init__(self, engine, params):
        self.params = params


SPEC = NodeSpec(
    reads=("prompts", "prompt_mask"),
    writes=("responses", "response_mask"),
    params=Params,
    worker=GenWorker,
    mode="rollout",
    head="lm",
    rows="repeat",
)
