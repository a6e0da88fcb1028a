"""A controller node that declares two outputs and returns one (for the node-call tests)."""

import attrs

from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    pass


def run(batch, params):
    scores = batch["scores"].float()
    return {"advantages": (scores - scores.mean())[:, None] * batch["response_mask"]}


SPEC = NodeSpec(
    reads=("scores", "response_mask"), writes=("advantages", "bonus"), params=Params, fn=run
)
