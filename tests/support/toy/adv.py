"""Toy group advantage: scores, uid -> advantages."""

import attrs

from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    eps: float = 1e-6
    mode: str = attrs.field(default="mean", validator=attrs.validators.in_(("mean", "max")))


def run(batch, params):
    return {"advantages": batch["scores"]}


SPEC = NodeSpec(reads=("scores", "uid"), writes=("advantages",), params=Params, fn=run, groups=True)
