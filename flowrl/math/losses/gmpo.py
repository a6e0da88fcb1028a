"""GMPO: PPO on the geometric mean of the token ratios (Zhao et al., "Geometric-Mean Policy
Optimization", arXiv 2507.20673).

Signature and conventions: `flowrl.math.losses.base`.
"""

from __future__ import annotations

from flowrl.lazy import torch
from flowrl.math import ops
from flowrl.math.losses.base import Chunk, approx_kl


def gmpo_loss(logprobs, old_logprobs, advantages, response_mask, params, chunk: Chunk):
    """GMPO loss; (b, t) inputs -> (loss, rates: clip_frac, approx_kl).

    J = 1/G sum_i sgn(A_i) * (prod_t min(r_i,t A_i, clip(r_i,t, e^-low, e^high) A_i))^(1/|y_i|)
    = 1/G sum_i A_i exp(mean_t l_i,t), where in log space l = sgn(A) min(sgn(A) log r,
    sgn(A) clip(log r, -low, high)) keeps the pessimistic side as PPO does. The range is
    clipped in log space, (e^-0.4, e^0.4) in the paper, wider than PPO's since a mean of
    token log-ratios moves less. A_i is the sequence's mean token advantage. Loss = mean over
    sequences (`chunk.num_seqs`) of -A_i exp(mean_t l_i,t), whatever `params.agg`. Token
    weights enter as their geometric mean per sequence. log r is clamped to [-20, 20] first.
    """
    mask = response_mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).clamp(-ops.MAX_LOG_RATIO, ops.MAX_LOG_RATIO)
    sign = torch.sign(advantages)
    in_range = log_ratio.clamp(-params.clip_low, params.clip_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * in_range)
    seq_ratio = torch.exp(ops.masked_mean(pessimistic, mask, dim=-1))  # (b,)
    seq_advantage = ops.masked_mean(advantages, mask, dim=-1)  # (b,)
    per_row = -seq_advantage * seq_ratio
    if chunk.token_weights is not None:
        log_weights = torch.log(chunk.token_weights.clamp(min=torch.finfo(mask.dtype).tiny))
        per_row = per_row * torch.exp(ops.masked_mean(log_weights, mask, dim=-1))
    clip_acts = (pessimistic != log_ratio) & (sign != 0)
    rates = {
        "clip_frac": float(ops.masked_mean(clip_acts.to(mask.dtype), mask)),
        "approx_kl": approx_kl(logprobs, old_logprobs, mask),
    }
    seqs = mask.shape[0] if chunk.num_seqs is None else chunk.num_seqs
    return per_row.sum() / seqs, rates
