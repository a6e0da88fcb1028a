"""GSPO: a sequence-level importance ratio (Zheng et al., "Group Sequence Policy Optimization",
arXiv 2507.18071).

Signature and conventions: `flowrl.math.losses.base`.
"""

from __future__ import annotations

from flowrl.lazy import torch
from flowrl.math import ops
from flowrl.math.losses.base import Chunk, approx_kl

# bound of the sequence log-ratio above, as verl's GSPO: exp(10) ~ 2.2e4. The per-token ratio
# is clamped with its gradient path, so where the bound acts the gradient is 0 (an unclamped
# exp would give a token of a negative-advantage row a gradient of order -A e^20).
MAX_SEQ_LOG_RATIO = 10.0


def gspo_loss(logprobs, old_logprobs, advantages, response_mask, params, chunk: Chunk):
    """GSPO-token loss; (b, t) inputs -> (loss, rates: clip_frac, approx_kl).

    s_i = exp(mean_t (logp_i,t - old_i,t)) = (pi(y_i) / pi_old(y_i))^(1 / |y_i|). In the
    paper's GSPO-token form, s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)]: its value is s_i on
    every token and its gradient s_i * grad log pi(y_i,t); with a sequence-level advantage it
    equals GSPO exactly. Loss per token: max(-A s_i,t, -A clip(s_i,t, 1 - low, 1 + high)),
    averaged per sequence then over sequences (the paper's 1/G sum_i 1/|y_i| sum_t, that is
    agg = "seq-mean-token-mean"). The paper's clip ranges are (3e-4, 4e-4): a length-normalised
    ratio stays near 1. log s_i,t is clamped to [-20, 10] (`MAX_SEQ_LOG_RATIO`) before exp,
    gradient included: a token whose sequence log-ratio is past a bound has no gradient.
    """
    mask = response_mask.to(logprobs.dtype)
    seq_log_ratio = ops.masked_mean((logprobs - old_logprobs).detach(), mask, dim=-1)  # (b,)
    # value: the sequence's log-ratio on every token; gradient: that of log pi(y_i,t)
    log_ratio = (logprobs - logprobs.detach()) + seq_log_ratio[:, None]  # (b, t)
    ratio = torch.exp(log_ratio.clamp(-ops.MAX_LOG_RATIO, MAX_SEQ_LOG_RATIO))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - params.clip_low, 1 + params.clip_high)
    loss = chunk.weighted(torch.maximum(unclipped, clipped))
    rates = {
        "clip_frac": float(ops.masked_mean((clipped > unclipped).to(loss.dtype), mask)),
        "approx_kl": approx_kl(logprobs, old_logprobs, mask),
    }
    return chunk.aggregate(loss, mask, params.agg), rates
