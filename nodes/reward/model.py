"""A learned reward model: the value head's output at each row's last response token.

reads: prompts, prompt_mask, responses, response_mask, response_attention -> writes: scores
The last response token is the last real one (response_attention): in a multi-turn row it may
be tool output, which the model reads like the rest of the conversation.
"""

from __future__ import annotations

import attrs

from flowrl.math import ops
from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    scale: float = 1.0  # multiply the model's score


def last_token_scores(values, mask):
    """values (b, t), mask (b, t) -> (b,): the value at each row's last 1 of the mask (0 for
    an empty row)."""
    last = ops.last_one(mask)  # (b,)
    return values.gather(-1, last[:, None]).squeeze(-1) * (mask.sum(-1) > 0)


class RewardModelWorker:
    def __init__(self, engine, params: Params):
        self.engine, self.params = engine, params

    def __call__(self, batch):
        values = self.engine.infer(batch)["values"]  # (b, t)
        scores = last_token_scores(values, ops.response_attention(batch)) * self.params.scale
        return {"scores": scores}, {"score": float(scores.mean()) if len(scores) else 0.0}


SPEC = NodeSpec(
    reads=("prompts", "prompt_mask", "responses", "response_mask", "response_attention"),
    writes=("scores",),
    params=Params,
    worker=RewardModelWorker,
    mode="inference",
    head="value",
)
