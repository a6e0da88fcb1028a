"""PPO's clipped surrogate (Schulman et al., arXiv 1707.06347) with DAPO's separate low and
high clip ranges (arXiv 2503.14476) and dual-clip (Ye et al., arXiv 1912.09729).

Signature and conventions: `flowrl.math.losses.base`.
"""

from __future__ import annotations

from flowrl.lazy import torch
from flowrl.math import ops
from flowrl.math.losses.base import Chunk


def ppo_loss(logprobs, old_logprobs, advantages, response_mask, params, chunk: Chunk):
    """Clipped surrogate loss; (b, t) inputs -> (loss, rates of this chunk).

    ratio r = exp(logp - old) with logp - old clamped to [-20, 20] (finite gradients for
    extreme tokens); loss per token = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), and
    with dual-clip c = `params.dual_clip` > 0, min(that, -A c) where A < 0. Rates: clip_frac
    (tokens where the clip binds), clip_frac_lower (tokens where the dual-clip bound -A c
    binds; verl's pg_clipfrac_lower), approx_kl (mean old - logp).
    """
    ratio = ops.ratio_from_log(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - params.clip_low, 1 + params.clip_high)
    loss = torch.maximum(unclipped, clipped)
    lower_binds = torch.zeros_like(loss, dtype=torch.bool)
    if params.dual_clip > 0:
        lower_binds = (advantages < 0) & (loss > -advantages * params.dual_clip)
        loss = torch.where(lower_binds, -advantages * params.dual_clip, loss)
    loss = chunk.weighted(loss)
    mask = response_mask.to(loss.dtype)
    rates = {
        "clip_frac": float(ops.masked_mean((clipped > unclipped).to(loss.dtype), mask)),
        "clip_frac_lower": float(ops.masked_mean(lower_binds.to(loss.dtype), mask)),
        "approx_kl": float(ops.masked_mean(old_logprobs - logprobs.detach(), mask)),
    }
    return chunk.aggregate(loss, mask, params.agg), rates
