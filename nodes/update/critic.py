"""Critic update: clipped value loss (PPO, arXiv 1707.06347; clipping as in OpenAI baselines;
the formula is `flowrl.math.losses.value.clipped_value_loss`).

reads: prompts, prompt_mask, responses, response_mask, response_attention, values, returns
       -> writes: -
The forward attends to response_attention; the loss counts only response_mask (sampled tokens).
"""

from __future__ import annotations

import attrs

from flowrl.hooks import MINI_BATCHES
from flowrl.math import ops
from flowrl.math.losses.value import clipped_value_loss
from flowrl.nodespec import NodeSpec
from flowrl.params import MAX_EPOCHS, MAX_ROWS, at_least, checked, count, one_of


@attrs.frozen
class Params:
    epochs: int = checked(1, count(1, MAX_EPOCHS))  # passes over the step's rows
    mini_batch_size: int = checked(0, count(0, MAX_ROWS))  # rows per optimizer step; 0 = all
    clip_range: float = checked(0.5, at_least(0))  # new values stay within old +- clip_range
    agg: str = checked("token-mean", one_of(ops.AGG_MODES))  # loss aggregation


class CriticUpdateWorker:
    def __init__(self, engine, params: Params):
        self.engine, self.params = engine, params

    def __call__(self, batch):
        p = self.params
        metrics = self.engine.update(
            batch,
            self.micro_loss,
            epochs=p.epochs,
            mini_batch_size=p.mini_batch_size,
            metrics=("vf_loss", "vf_clip_frac", "value_mean"),
        )
        return {}, metrics

    def micro_loss(self, micro, counts) -> tuple:
        """The loss of one micro-batch and its metrics (see `TrainEngine.update`)."""
        p, mask = self.params, micro["response_mask"]
        values = self.engine.forward(micro, grad=True)["values"]
        loss, rates = clipped_value_loss(
            values,
            micro["values"],
            micro["returns"],
            mask,
            p.clip_range,
            p.agg,
            counts.num_tokens,
            counts.num_seqs,
        )
        share = counts.share(mask)
        return loss, {"vf_loss": float(loss.detach())} | {k: v * share for k, v in rates.items()}


SPEC = NodeSpec(
    reads=(
        "prompts",
        "prompt_mask",
        "responses",
        "response_mask",
        "response_attention",
        "values",
        "returns",
    ),
    writes=(),
    params=Params,
    worker=CriticUpdateWorker,
    mode="train",
    head="value",
    check=MINI_BATCHES.check,
    updates_per_step=MINI_BATCHES.updates,
)
