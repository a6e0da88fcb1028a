"""Toy reward: responses -> scores."""

import attrs

from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    scale: float = 1.0


def run(batch, params):
    return {"scores": batch["responses"].sum(-1) * params.scale}


SPEC = NodeSpec(reads=("responses",), writes=("scores",), params=Params, fn=run)
