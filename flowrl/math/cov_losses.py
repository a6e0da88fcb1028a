"""Clip-Cov and KL-Cov: keep entropy from collapsing by restraining the few tokens whose
log-prob and advantage co-vary most (Cui et al., "The Entropy Mechanism of Reinforcement
Learning for Reasoning Language Models", arXiv 2505.22617).

The paper shows the entropy change of a policy-gradient step is driven by the covariance of a
token's log-prob and its advantage; a small set of high-covariance tokens drives the collapse.
Shapes and conventions as in `flowrl.math.policy_losses`: (b, t) inputs, (loss, metrics) out. The
covariance is taken over this chunk's tokens (a micro-batch, as in the paper's verl code).
"""

from __future__ import annotations

from flowrl.lazy import torch
from flowrl.math import ops


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


def clip_cov_policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    response_mask,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
    agg: str = "token-mean",
    num_tokens=None,
    num_seqs=None,
    norm_length=None,
    token_weights=None,
    generator=None,
):
    """Clip-Cov: detach the gradient of r * N random tokens with cov_low < Cov < cov_high.

    Among the tokens the PPO clip leaves unclipped, those whose covariance lies strictly
    between the bounds are candidates; `_count(clip_cov_ratio)` of them, drawn at random with
    `generator`, keep their loss value but lose their gradient. The rest is the PPO clipped
    surrogate (ratio clamped in log space to [-20, 20]). Defaults are the paper's and verl's:
    r = 2e-4, bounds (1, 5). Metrics: clip_frac (PPO clip), cov_frac (detached tokens).
    """
    mask = response_mask.to(logprobs.dtype)
    ratio = ops.ratio_from_log(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    ppo_clipped = clipped > unclipped
    cov = token_covariance(logprobs, advantages, mask)
    candidates = (mask > 0) & ~ppo_clipped & (cov > cov_low) & (cov < cov_high)
    rows, cols = candidates.nonzero(as_tuple=True)
    pick = torch.randperm(len(rows), generator=generator)[: _count(clip_cov_ratio, mask)]
    pick = pick.to(rows.device)
    selected = torch.zeros_like(candidates)
    selected[rows[pick], cols[pick]] = True
    loss = torch.maximum(unclipped, clipped)
    loss = torch.where(selected, loss.detach(), loss)
    if token_weights is not None:
        loss = loss * token_weights
    metrics = {
        "clip_frac": float(ops.masked_mean(ppo_clipped.to(mask.dtype), mask)),
        "cov_frac": float(ops.masked_mean(selected.to(mask.dtype), mask)),
        "approx_kl": float(ops.masked_mean(old_logprobs - logprobs.detach(), mask)),
    }
    return ops.agg_loss(loss, mask, agg, num_tokens, num_seqs, norm_length), metrics


def kl_cov_policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    response_mask,
    kl_cov_ratio: float = 2e-4,
    kl_coef: float = 1.0,
    agg: str = "token-mean",
    num_tokens=None,
    num_seqs=None,
    norm_length=None,
    token_weights=None,
):
    """KL-Cov: a KL penalty on the k * N tokens of largest covariance, no clip.

    Loss per token = -A r, plus kl_coef * |logp - old| on the top `_count(kl_cov_ratio)`
    tokens by Cov (the paper's beta |log r|). Defaults are verl's: k = 2e-4, beta = 1 (the
    paper tunes k per model size). Metrics: cov_frac (penalised tokens), approx_kl.
    """
    mask = response_mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    loss = -advantages * ops.ratio_from_log(log_ratio)
    cov = token_covariance(logprobs, advantages, mask).masked_fill(mask == 0, -torch.inf)
    top = cov.flatten().topk(min(_count(kl_cov_ratio, mask), int(mask.sum()))).indices
    selected = torch.zeros_like(cov, dtype=torch.bool).flatten()
    selected[top] = True
    selected = selected.view_as(cov)
    loss = loss + torch.where(selected, kl_coef * log_ratio.abs(), 0.0)
    if token_weights is not None:
        loss = loss * token_weights
    metrics = {
        "cov_frac": float(ops.masked_mean(selected.to(mask.dtype), mask)),
        "approx_kl": float(ops.masked_mean(old_logprobs - logprobs.detach(), mask)),
    }
    return ops.agg_loss(loss, mask, agg, num_tokens, num_seqs, norm_length), metrics
