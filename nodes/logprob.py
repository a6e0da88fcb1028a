"""Log-probability of each response token under a model (old policy, or the reference).

reads: prompts, prompt_mask, responses, response_mask, response_attention -> writes: logprobs
Graphs use it twice with rename: `old_logprobs` from the policy, `ref_logprobs` from the ref
(or, for a LoRA policy, from the policy itself with `adapter = false`: its frozen base).
"""

from __future__ import annotations

from contextlib import nullcontext

import attrs

from flowrl.models import lora
from flowrl.nodespec import NodeSpec
from flowrl.params import checked, positive


@attrs.frozen
class Params:
    temperature: float = checked(1.0, positive())  # divide logits as the sampler did
    adapter: bool = True  # false: the LoRA model's base, adapter off (the reference policy)


class LogprobWorker:
    def __init__(self, engine, params: Params):
        self.engine, self.params = engine, params
        if not params.adapter and not lora.has_adapter(engine.module):
            raise ValueError("adapter = false needs a model with a LoRA adapter (set its lora)")

    def __call__(self, batch):
        base = lora.adapters_off(self.engine.module) if not self.params.adapter else nullcontext()
        with base:
            out = self.engine.infer(batch, temperature=self.params.temperature)
        return {"logprobs": out["logprobs"]}  # (b, t)


SPEC = NodeSpec(
    reads=("prompts", "prompt_mask", "responses", "response_mask", "response_attention"),
    writes=("logprobs",),
    params=Params,
    worker=LogprobWorker,
    mode="inference",
    head="lm",
)
