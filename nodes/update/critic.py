"""Critic update: clipped value loss (PPO, arXiv 1707.06347; clipping as in OpenAI baselines).

reads: prompts, prompt_mask, responses, response_mask, response_attention, values, returns
       -> writes: -
The forward attends to response_attention; the loss counts only response_mask (sampled tokens).
"""

from __future__ import annotations

import attrs

from flowrl.front.validators import MAX_EPOCHS, MAX_ROWS, at_least, checked, count, one_of
from flowrl.lazy import torch
from flowrl.math import ops
from flowrl.nodespec import MINI_BATCHES, NodeSpec


@attrs.frozen
class Params:
    epochs: int = checked(1, count(1, MAX_EPOCHS))  # passes over the step's rows
    mini_batch_size: int = checked(0, count(0, MAX_ROWS))  # rows per optimizer step; 0 = all
    clip_range: float = checked(0.5, at_least(0))  # new values stay within old +- clip_range
    agg: str = checked("token-mean", one_of(ops.AGG_MODES))  # loss aggregation


def clipped_value_loss(
    values,
    old_values,
    returns,
    response_mask,
    clip_range=0.5,
    agg="token-mean",
    num_tokens=None,
    num_seqs=None,
):
    """0.5 * max((V - R)^2, (V_clipped - R)^2), V_clipped = V_old + clip(V - V_old, +-c).

    All inputs (b, t). Returns (loss, metrics of this chunk).
    """
    clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
    plain_error = (values - returns) ** 2
    clipped_error = (clipped - returns) ** 2
    mask = response_mask.to(values.dtype)
    loss = 0.5 * ops.agg_loss(
        torch.maximum(plain_error, clipped_error), mask, agg, num_tokens, num_seqs
    )
    metrics = {
        "vf_clip_frac": float(ops.masked_mean((clipped_error > plain_error).to(mask.dtype), mask)),
        "value_mean": float(ops.masked_mean(values.detach(), mask)),
    }
    return loss, metrics


class CriticUpdateWorker:
    def __init__(self, engine, params: Params):
        self.engine, self.params = engine, params

    def __call__(self, batch):
        p, engine = self.params, self.engine
        steps = [
            self.mini_batch(mini)
            for _ in range(p.epochs)
            for mini in engine.mini_batches(batch, p.mini_batch_size)
        ]
        return {}, ops.mean_metrics(steps)

    def mini_batch(self, mini) -> dict:
        p, engine = self.params, self.engine
        num_tokens = max(engine.all_reduce_sum(float(mini["response_mask"].sum())), 1)
        num_seqs = max(engine.all_reduce_sum(len(mini)), 1)
        totals = {"vf_loss": 0.0, "vf_clip_frac": 0.0, "value_mean": 0.0}
        for micro in engine.micro_batches(mini):
            if len(micro) == 0:
                continue
            values = engine.forward(micro, grad=True)["values"]
            loss, metrics = clipped_value_loss(
                values,
                micro["values"],
                micro["returns"],
                micro["response_mask"],
                p.clip_range,
                p.agg,
                num_tokens,
                num_seqs,
            )
            engine.backward(loss)
            share = float(micro["response_mask"].sum()) / num_tokens
            totals["vf_loss"] += float(loss.detach())
            totals["vf_clip_frac"] += metrics["vf_clip_frac"] * share
            totals["value_mean"] += metrics["value_mean"] * share
        totals = {k: engine.all_reduce_sum(v) for k, v in totals.items()}
        return {**totals, **engine.step()}


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
