"""CISPO: clip the importance weight, not the update (MiniMax-M1, arXiv 2506.13585).

Signature and conventions: `flowrl.math.losses.base`.
"""

from __future__ import annotations

from flowrl.math import ops
from flowrl.math.losses.base import Chunk, approx_kl


def cispo_loss(logprobs, old_logprobs, advantages, response_mask, params, chunk: Chunk):
    """CISPO loss; (b, t) inputs -> (loss, rates: clip_frac, approx_kl).

    J = sum_i,t sg(r_hat_i,t) A_i,t log pi(y_i,t) / sum_i |y_i|, with r = exp(logp - old) and
    r_hat = clip(r, 1 - clip_low, 1 + clip_high). Unlike PPO no token loses its gradient: a
    clipped token still contributes through log pi, only with a bounded weight. The paper sets
    no lower bound and tunes only the upper one: `clip_low = None` (a Python caller's choice;
    a graph's clip_low is a number) leaves the weight unbounded below. Loss per token:
    -sg(r_hat) A logp.
    """
    mask = response_mask.to(logprobs.dtype)
    ratio = ops.ratio_from_log(logprobs - old_logprobs).detach()
    floor = None if params.clip_low is None else 1 - params.clip_low
    weight = ratio.clamp(min=floor, max=1 + params.clip_high)
    loss = chunk.weighted(-weight * advantages * logprobs)
    rates = {
        "clip_frac": float(ops.masked_mean((weight != ratio).to(loss.dtype), mask)),
        "approx_kl": approx_kl(logprobs, old_logprobs, mask),
    }
    return chunk.aggregate(loss, mask, params.agg), rates
