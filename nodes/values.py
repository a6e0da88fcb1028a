"""The critic's value estimate at each response token.

reads: prompts, prompt_mask, responses, response_mask, response_attention -> writes: values
"""

from __future__ import annotations

import attrs

from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    pass


class ValuesWorker:
    def __init__(self, engine, params: Params):
        self.engine, self.params = engine, params

    def __call__(self, batch):
        return {"values": self.engine.infer(batch)["values"]}  # (b, t)


SPEC = NodeSpec(
    reads=("prompts", "prompt_mask", "responses", "response_mask", "response_attention"),
    writes=("values",),
    params=Params,
    worker=ValuesWorker,
    mode="inference",
    head="value",
)
