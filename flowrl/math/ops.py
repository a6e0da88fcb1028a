"""Tensor math shared by nodes: masked statistics, loss aggregation, KL estimators.

Imports torch lazily so node modules that use it still load without torch (`flowrl check`).
"""

from __future__ import annotations

from flowrl.lazy import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3", "abs")
MAX_LOG_RATIO = 20.0  # |log-ratio| bound before exp, as verl: exp(20) ~ 4.9e8 stays finite


def ratio_from_log(log_ratio):
    """exp(log_ratio) with log_ratio clamped to [-20, 20] first (any shape).

    A token the sampler drew with a tiny probability can give a log-ratio of hundreds; exp of it
    is inf in float32, and inf x 0 in a clipped branch's backward turns every gradient to NaN.
    Where the clamp acts the gradient is 0, as for a clipped token.
    """
    return torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def metric_value(x):
    """A metric of a micro-batch: a float from a CPU tensor; from a device tensor, a detached
    float64 tensor, so that summing the micro-batches' metrics waits for nothing (the update
    loop reads them once per mini-batch)."""
    x = x.detach()
    return float(x) if x.device.type == "cpu" else x.double()


def masked_sum(x, mask, dim=None):
    mask = mask.to(x.dtype)
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x, mask, dim=None):
    """Mean of x over mask == 1 (0 where the mask is empty)."""
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x, mask):
    """Unbiased variance of x over mask == 1."""
    mean = masked_mean(x, mask)
    count = mask.to(x.dtype).sum()
    return masked_sum((x - mean) ** 2, mask) / (count - 1).clamp(min=1)


def masked_whiten(x, mask, shift_mean: bool = True, eps: float = 1e-8):
    """(x - mean) / std over mask == 1; with shift_mean=False the mean is added back."""
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    return whitened if shift_mean else whitened + mean


def agg_loss(
    token_loss, mask, mode: str = "token-mean", num_tokens=None, num_seqs=None, norm_length=None
):
    """token_loss (b, t), mask (b, t) -> scalar.

    token-mean: sum over tokens / tokens; seq-mean-token-sum: per-row sums / rows;
    seq-mean-token-mean: per-row means / rows; seq-mean-token-sum-norm (Dr. GRPO, arXiv
    2503.20783): per-row sums / `norm_length`, a constant, / rows. `norm_length` defaults to t,
    the padded response length; pass the generation's max response length so the divisor stays
    the same across steps and micro-batches, as the paper intends. `num_tokens` / `num_seqs` are
    the counts of the whole mini-batch (all micro-batches, all ranks): summing the chunks' losses
    then gives the loss of the whole mini-batch exactly. They default to this chunk's counts.
    """
    mask = mask.to(token_loss.dtype)
    if mode == "token-mean":
        return (token_loss * mask).sum() / (mask.sum() if num_tokens is None else num_tokens)
    per_row = (token_loss * mask).sum(-1)  # (b,)
    if mode == "seq-mean-token-mean":
        per_row = per_row / mask.sum(-1).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        per_row = per_row / (mask.shape[-1] if norm_length is None else norm_length)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown loss aggregation {mode!r}; use one of {AGG_MODES}")
    return per_row.sum() / (mask.shape[0] if num_seqs is None else num_seqs)


def kl_estimate(logprobs, ref_logprobs, kind: str = "k1"):
    """Per-token estimate of KL(policy || ref) from log-probs of sampled tokens (b, t).

    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) - 1 + log r (low variance, always >= 0;
    clamped to [-10, 10]), abs = |log r|, with log r = logprobs - ref_logprobs
    (Schulman, "Approximating KL divergence", 2020). For k3, log r is clamped to [-20, 20]
    before exp (as verl), so an extreme token gives a finite value and gradient.
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        return (torch.exp(-log_ratio) - 1 + log_ratio).clamp(-10, 10)
    if kind == "abs":
        return log_ratio.abs()
    raise ValueError(f"unknown KL estimator {kind!r}; use one of {KL_KINDS}")


def last_one(mask):
    """mask (b, t) 0/1 -> (b,) int64: the index of each row's last 1 (0 for a row of zeros).

    Not `mask.sum(-1) - 1`: a multi-turn `response_mask` has holes (tool output, 0 inside
    a row), and the sum then points before the end.
    """
    if mask.shape[-1] == 0:
        return torch.zeros(mask.shape[0], dtype=torch.long)
    positions = torch.arange(mask.shape[-1], device=mask.device)  # (t,)
    return (positions * mask.bool()).argmax(-1)  # the largest position holding a 1


def response_attention(batch):
    """The tokens a forward attends to, (b, t): `response_attention` (every real response
    token: the policy's and tool output) where the batch has it, else `response_mask`; the
    two are equal for single-turn rows."""
    return batch["response_attention"] if "response_attention" in batch else batch["response_mask"]


def group_ids(uid):
    """uid (b,) -> dense group index (b,) and group count."""
    _, index = torch.unique(uid, return_inverse=True)
    return index, int(index.max()) + 1 if len(index) else 0


def group_sum_count(values, uid):
    """values (b,), uid (b,) -> each row's group sum (b,) and group size (b,)."""
    index, groups = group_ids(uid)
    values = values.float()
    total = torch.zeros(groups).index_add_(0, index, values)
    count = torch.zeros(groups).index_add_(0, index, torch.ones_like(values))
    return total[index], count[index]


def mean_metrics(results: list[dict]) -> dict:
    """The mean of each metric over a list of metric dicts (e.g. one per optimizer step)."""
    keys = {k for r in results for k in r}
    return {k: sum(r[k] for r in results if k in r) / sum(k in r for r in results) for k in keys}
