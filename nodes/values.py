"""The critic's value estimate at each response token.

reads: prompts, prompt_mask, responses, response_mask -> writes: values
"""

from __future__ import annotations

import attrs

from flowrl.lazy import torch
from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    pass


class ValuesWorker:
    def __init__(self, engine, params: Params):
        self.engine, self.params = engine, params

    def __call__(self, batch):
        parts = [
            self.engine.forward(micro, grad=False) for micro in self.engine.micro_batches(batch)
        ]
        return {"values": torch.cat([p["values"] for p in parts])}  # (b, t)


SPEC = NodeSpec(
    reads=("prompts", "prompt_mask", "responses", "response_mask"),
    writes=("values",),
    params=Params,
    worker=ValuesWorker,
    mode="inference",
    head="value",
)
