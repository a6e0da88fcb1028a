"""The critic's clipped value loss (PPO, arXiv 1707.06347; clipping as in OpenAI baselines).

Used by `update.critic`; not in `LOSSES`, the table `update.policy` chooses a policy loss from.
"""

from __future__ import annotations

from flowrl.lazy import torch
from flowrl.math import ops


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

    All inputs (b, t). Returns (loss, metrics of this chunk: vf_clip_frac, value_mean).
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
