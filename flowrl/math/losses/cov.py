"""Clip-Cov and KL-Cov: keep entropy from collapsing by restraining the few tokens whose
log-prob and advantage co-vary most (Cui et al., "The Entropy Mechanism of Reinforcement
Learning for Reasoning Language Models", arXiv 2505.22617).

The paper shows the entropy change of a policy-gradient step is driven by the covariance of a
token's log-prob and its advantage; a small set of high-covariance tokens drives the collapse.
The covariance is taken over this chunk's tokens (a micro-batch, as in the paper's verl code),
so both losses need every row of it (`Loss.all_rows`). Signature and conventions:
`flowrl.math.losses.base`.
"""

from __future__ import annotations

from flowrl.lazy import torch
from flowrl.math import ops
from flowrl.math.losses.base import Chunk, approx_kl

COV_LOW, COV_HIGH = 1.0, 5.0  # Clip-Cov's covariance band, the paper's and verl's


def token_covariance(logprobs, advantages, response_mask):
    """(b, t) each -> (b, t), detached: Cov_i = (logp_i - mean logp) (A_i - mean A).

    Means over the tokens where response_mask == 1; padding positions are 0.
    """
    mask = response_mask.to(logprobs.dtype)
    logprobs = logprobs.detach()
    centred_logp = logprobs - ops.masked_mean(logprobs, mask)
    centred_adv = advantages - ops.masked_mean(advantages, mask)
    return centred_logp * centred_adv * mask


def _count(fraction: float, mask) -> int:
    """The paper's r * N (or k * N) tokens, at least one."""
    return max(int(fraction * float(mask.sum())), 1)


def clip_cov_loss(logprobs, old_logprobs, advantages, response_mask, params, chunk: Chunk):
    """Clip-Cov: detach the gradient of r * N random tokens with COV_LOW < Cov < COV_HIGH.

    Among the tokens the PPO clip leaves unclipped, those whose covariance lies strictly
    between the bounds are candidates; `_count(params.cov_ratio)` of them, drawn at random
    with `chunk.generator`, keep their loss value but lose their gradient. The rest is the PPO
    clipped surrogate (ratio clamped in log space to [-20, 20]). Defaults are the paper's and
    verl's: r = 2e-4, bounds (1, 5). Rates: clip_frac (PPO clip), cov_frac (detached tokens),
    approx_kl.
    """
    mask = response_mask.to(logprobs.dtype)
    ratio = ops.ratio_from_log(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - params.clip_low, 1 + params.clip_high)
    ppo_clipped = clipped > unclipped
    cov = token_covariance(logprobs, advantages, mask)
    candidates = (mask > 0) & ~ppo_clipped & (cov > COV_LOW) & (cov < COV_HIGH)
    rows, cols = candidates.nonzero(as_tuple=True)
    pick = torch.randperm(len(rows), generator=chunk.generator)[: _count(params.cov_ratio, mask)]
    pick = pick.to(rows.device)
    selected = torch.zeros_like(candidates)
    selected[rows[pick], cols[pick]] = True
    loss = torch.maximum(unclipped, clipped)
    loss = chunk.weighted(torch.where(selected, loss.detach(), loss))
    rates = {
        "clip_frac": float(ops.masked_mean(ppo_clipped.to(mask.dtype), mask)),
        "cov_frac": float(ops.masked_mean(selected.to(mask.dtype), mask)),
        "approx_kl": approx_kl(logprobs, old_logprobs, mask),
    }
    return chunk.aggregate(loss, mask, params.agg), rates


def kl_cov_loss(logprobs, old_logprobs, advantages, response_mask, params, chunk: Chunk):
    """KL-Cov: a KL penalty on the k * N tokens of largest covariance, no clip.

    Loss per token = -A r, plus cov_kl_coef * |logp - old| on the top
    `_count(params.cov_ratio)` tokens by Cov (the paper's beta |log r|). Defaults are verl's:
    k = 2e-4, beta = 1 (the paper tunes k per model size). Rates: cov_frac (penalised
    tokens), approx_kl.
    """
    mask = response_mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    loss = -advantages * ops.ratio_from_log(log_ratio)
    cov = token_covariance(logprobs, advantages, mask).masked_fill(mask == 0, -torch.inf)
    top = cov.flatten().topk(min(_count(params.cov_ratio, mask), int(mask.sum()))).indices
    selected = torch.zeros_like(cov, dtype=torch.bool).flatten()
    selected[top] = True
    selected = selected.view_as(cov)
    loss = chunk.weighted(loss + torch.where(selected, params.cov_kl_coef * log_ratio.abs(), 0.0))
    rates = {
        "cov_frac": float(ops.masked_mean(selected.to(mask.dtype), mask)),
        "approx_kl": approx_kl(logprobs, old_logprobs, mask),
    }
    return chunk.aggregate(loss, mask, params.agg), rates
