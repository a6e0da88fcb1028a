"""Toy stateful controller node: counts the rows it saw (stateful nodes always run)."""

import attrs

from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    pass


def run(batch, params, state):
    state["rows"] = state.get("rows", 0) + len(batch)
    return {"advantages": batch["scores"]}


SPEC = NodeSpec(
    reads=("scores", "uid"), writes=("advantages",), params=Params, fn=run, stateful=True
)
