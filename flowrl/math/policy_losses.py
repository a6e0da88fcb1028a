"""Policy losses beyond PPO's clipped surrogate: GSPO, CISPO, GPG, GMPO, SAPO, and truncated
importance sampling (TIS) between the rollout backend's and the trainer's log-probs.

Every loss takes (b, t) tensors — `logprobs` (this forward, with grad), `old_logprobs` (the
policy that sampled, detached), `advantages`, `response_mask` — and returns (loss, metrics):
a scalar and a dict of floats over this chunk. `agg`, `num_tokens`, `num_seqs` and
`norm_length` are passed to `ops.agg_loss`: the counts of the whole mini-batch, so the losses of
its micro-batches add up to its loss, and the constant divisor of seq-mean-token-sum-norm.
`token_weights` (b, t), e.g. from `tis_weights`, multiply each token's loss before aggregation.
Every exp of a log-ratio goes through `ops.ratio_from_log` (clamped to [-20, 20]).
"""

from __future__ import annotations

from flowrl.lazy import torch
from flowrl.math import ops


def _weighted(token_loss, token_weights):
    return token_loss if token_weights is None else token_loss * token_weights


def _approx_kl(logprobs, old_logprobs, mask) -> float:
    return float(ops.masked_mean(old_logprobs - logprobs.detach(), mask))


def tis_weights(old_logprobs, rollout_logprobs, cap: float):
    """Truncated importance-sampling weights between trainer and rollout backend (b, t).

    w = min(exp(old - rollout), C), detached, where `old_logprobs` are the trainer's log-probs
    of the sampled tokens before the update and `rollout_logprobs` the sampler's (vLLM, SGLang:
    they differ by kernels and precision). Multiplying w into the policy-gradient loss corrects
    for sampling from the rollout engine's distribution (Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training"; C is verl's `tis_imp_ratio_cap`).
    """
    ratio = ops.ratio_from_log(old_logprobs - rollout_logprobs)
    return ratio.clamp(max=cap).detach()


def gspo_policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    response_mask,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    agg: str = "seq-mean-token-mean",
    num_tokens=None,
    num_seqs=None,
    norm_length=None,
    token_weights=None,
):
    """GSPO: a sequence-level importance ratio (Zheng et al., arXiv 2507.18071).

    s_i = exp(mean_t (logp_i,t - old_i,t)) = (pi(y_i) / pi_old(y_i))^(1 / |y_i|). In the
    paper's GSPO-token form, s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)]: its value is s_i on
    every token and its gradient s_i * grad log pi(y_i,t); with a sequence-level advantage it
    equals GSPO exactly. Loss per token: max(-A s_i,t, -A clip(s_i,t, 1 - low, 1 + high)),
    averaged per sequence then over sequences (the paper's 1/G sum_i 1/|y_i| sum_t). The
    clip ranges are the paper's (3e-4, 4e-4): a length-normalised ratio stays near 1. The
    sequence log-ratio is clamped to [-20, 20] before exp.
    """
    mask = response_mask.to(logprobs.dtype)
    seq_log_ratio = ops.masked_mean((logprobs - old_logprobs).detach(), mask, dim=-1)  # (b,)
    seq_ratio = ops.ratio_from_log(seq_log_ratio)[:, None]
    ratio = seq_ratio * torch.exp(logprobs - logprobs.detach())  # value s_i, grad via logp
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = _weighted(torch.maximum(unclipped, clipped), token_weights)
    metrics = {
        "clip_frac": float(ops.masked_mean((clipped > unclipped).to(loss.dtype), mask)),
        "approx_kl": _approx_kl(logprobs, old_logprobs, mask),
    }
    return ops.agg_loss(loss, mask, agg, num_tokens, num_seqs, norm_length), metrics


def cispo_policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    response_mask,
    clip_low: float | None = None,
    clip_high: float = 0.28,
    agg: str = "token-mean",
    num_tokens=None,
    num_seqs=None,
    norm_length=None,
    token_weights=None,
):
    """CISPO: clip the importance weight, not the update (MiniMax-M1, arXiv 2506.13585).

    J = sum_i,t sg(r_hat_i,t) A_i,t log pi(y_i,t) / sum_i |y_i|, with r = exp(logp - old) and
    r_hat = clip(r, 1 - low, 1 + high). Unlike PPO no token loses its gradient: a clipped
    token still contributes through log pi, only with a bounded weight. The paper sets no
    lower bound (`clip_low=None`) and tunes only the upper one; 0.28 (DAPO's clip-higher) is a
    starting value here, not a number from the paper. Loss per token: -sg(r_hat) A logp.
    """
    mask = response_mask.to(logprobs.dtype)
    ratio = ops.ratio_from_log(logprobs - old_logprobs).detach()
    floor = None if clip_low is None else 1 - clip_low
    weight = ratio.clamp(min=floor, max=1 + clip_high)
    loss = _weighted(-weight * advantages * logprobs, token_weights)
    metrics = {
        "clip_frac": float(ops.masked_mean((weight != ratio).to(loss.dtype), mask)),
        "approx_kl": _approx_kl(logprobs, old_logprobs, mask),
    }
    return ops.agg_loss(loss, mask, agg, num_tokens, num_seqs, norm_length), metrics


def gpg_policy_loss(
    logprobs,
    advantages,
    response_mask,
    agg: str = "token-mean",
    num_tokens=None,
    num_seqs=None,
    norm_length=None,
    token_weights=None,
):
    """GPG: the plain policy gradient, no ratio, no clip (Chu et al., arXiv 2504.02546).

    Loss = -sum_i,t A_i,t log pi(y_i,t) / sum_i |y_i| (token-mean). GPG's correction of the
    advantages (alpha = B / (B - M) for the M rows of zero-variance groups) is in
    `flowrl.math.estimators.gpg_advantages`. Strictly on-policy: every step samples afresh.
    """
    mask = response_mask.to(logprobs.dtype)
    loss = _weighted(-advantages * logprobs, token_weights)
    return ops.agg_loss(loss, mask, agg, num_tokens, num_seqs, norm_length), {}


def gmpo_policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    response_mask,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
    num_seqs=None,
    token_weights=None,
):
    """GMPO: PPO on the geometric mean of the token ratios (Zhao et al., arXiv 2507.20673).

    J = 1/G sum_i sgn(A_i) * (prod_t min(r_i,t A_i, clip(r_i,t, e^-low, e^high) A_i))^(1/|y_i|)
    = 1/G sum_i A_i exp(mean_t l_i,t), where in log space l = sgn(A) min(sgn(A) log r,
    sgn(A) clip(log r, -low, high)) keeps the pessimistic side as PPO does. The range is
    clipped in log space, (e^-0.4, e^0.4) in the paper, wider than PPO's since a mean of
    token log-ratios moves less. A_i is the sequence's mean token advantage. Loss = mean over
    sequences of -A_i exp(mean_t l_i,t). `token_weights` enter as their geometric mean per
    sequence. log r is clamped to [-20, 20] first.
    """
    mask = response_mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).clamp(-ops.MAX_LOG_RATIO, ops.MAX_LOG_RATIO)
    sign = torch.sign(advantages)
    in_range = log_ratio.clamp(-clip_low, clip_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * in_range)
    seq_ratio = torch.exp(ops.masked_mean(pessimistic, mask, dim=-1))  # (b,)
    seq_advantage = ops.masked_mean(advantages, mask, dim=-1)  # (b,)
    per_row = -seq_advantage * seq_ratio
    if token_weights is not None:
        log_weights = torch.log(token_weights.clamp(min=torch.finfo(mask.dtype).tiny))
        per_row = per_row * torch.exp(ops.masked_mean(log_weights, mask, dim=-1))
    clip_acts = (pessimistic != log_ratio) & (sign != 0)
    metrics = {
        "clip_frac": float(ops.masked_mean(clip_acts.to(mask.dtype), mask)),
        "approx_kl": _approx_kl(logprobs, old_logprobs, mask),
    }
    return per_row.sum() / (mask.shape[0] if num_seqs is None else num_seqs), metrics


def sapo_policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    response_mask,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    agg: str = "seq-mean-token-mean",
    num_tokens=None,
    num_seqs=None,
    norm_length=None,
    token_weights=None,
):
    """SAPO: a soft, temperature-controlled gate instead of the hard clip (Gao et al., "Soft
    Adaptive Policy Optimization", arXiv 2511.20347).

    J = 1/G sum_i 1/|y_i| sum_t f_i,t(r_i,t) A_i,t with f(r) = (4 / tau) sigmoid(tau (r - 1))
    and tau = tau_pos where A > 0, tau_neg otherwise (the paper's 1.0 and 1.05: negative
    advantages, which push up many unsampled tokens, are damped faster). The gradient weight
    on grad log pi is f'(r) r = 4 s (1 - s) r with s = sigmoid(tau (r - 1)): 1 at r = 1,
    decaying smoothly as r leaves 1. Loss per token: -f(r) A; metric `gate`: mean 4 s (1 - s).
    """
    mask = response_mask.to(logprobs.dtype)
    ratio = ops.ratio_from_log(logprobs - old_logprobs)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(logprobs.dtype)
    gate = torch.sigmoid(tau * (ratio - 1))
    loss = _weighted(-(4 / tau) * gate * advantages, token_weights)
    gate = gate.detach()
    metrics = {
        "gate": float(ops.masked_mean(4 * gate * (1 - gate), mask)),
        "approx_kl": _approx_kl(logprobs, old_logprobs, mask),
    }
    return ops.agg_loss(loss, mask, agg, num_tokens, num_seqs, norm_length), metrics
