"""Toy stateful advantage: scores times the number of calls so far (state kept across steps)."""

import attrs

from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    scale: float = 1.0


def run(batch, params, state):
    state["calls"] = state.get("calls", 0) + 1
    return {"advantages": batch["scores"] * state["calls"] * params.scale}


SPEC = NodeSpec(
    reads=("scores", "uid"), writes=("advantages",), params=Params, fn=run, stateful=True
)
