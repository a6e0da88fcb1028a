"""Log-probability of each response token under a model (old policy, or the reference).

reads: prompts, prompt_mask, responses, response_mask, response_attention -> writes: logprobs
Graphs use it twice with rename: `old_logprobs` from the policy, `ref_logprobs` from the ref.
"""

from __future__ import annotations

import attrs

from flowrl.nodespec import NodeSpec
from flowrl.validators import checked, positive


@attrs.frozen
class Params:
    temperature: float = checked(1.0, positive())  # divide logits as the sampler did


class LogprobWorker:
    def __init__(self, engine, params: Params):
        self.engine, self.params = engine, params

    def __call__(self, batch):
        return {
            "logprobs": self.engine.infer(batch, temperature=self.params.temperature)["logprobs"]
        }  # (b, t)


SPEC = NodeSpec(
    reads=("prompts", "prompt_mask", "responses", "response_mask", "response_attention"),
    writes=("logprobs",),
    params=Params,
    worker=LogprobWorker,
    mode="inference",
    head="lm",
)
