"""A policy update whose loss is NaN (for the non-finite tests): the engine must skip it."""

import attrs

from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    kl_loss_coef: float = 0.0  # accepted so it can stand in for grpo.toml's update node
    on_policy: bool = True


class NanUpdateWorker:
    def __init__(self, engine, params):
        self.engine, self.params = engine, params

    def __call__(self, batch):
        logprobs = self.engine.forward(batch, grad=True)["logprobs"]  # (b, t)
        self.engine.backward(logprobs.sum() * float("nan"))
        return {}, self.engine.step()


SPEC = NodeSpec(
    reads=("prompts", "prompt_mask", "responses", "response_mask", "response_attention"),
    writes=(),
    params=Params,
    worker=NanUpdateWorker,
    mode="train",
    head="lm",
)
