"""Group advantage estimators as pure functions: GRPO's (arXiv 2402.03300), pass@k (arXiv
2508.10751), OPO (arXiv 2505.23585) and GPG's corrected group advantage (arXiv 2504.02546).

Each maps per-row scores (b,) and group ids `uid` (b,) (rows sampled from the same prompt share
one) to per-row advantages (b,); a node broadcasts them over the response tokens as
`adv[:, None] * response_mask`. They live here, beside `flowrl.math.ops`, rather than as node
modules under nodes/advantage/, so that the node that exposes one to graph files (its params,
its reads and writes, its docs entries) can be written and reviewed on its own.
"""

from __future__ import annotations

from flowrl.lazy import torch
from flowrl.math import ops


def group_advantages(scores, uid, scale_by_std: bool = True, eps: float = 1e-6):
    """scores (b,), uid (b,) -> (b,): score minus its group's mean [/ (group std + eps)].

    Groups of one sample get 0 (no baseline to compare with).
    """
    scores = scores.float()
    total, count = ops.group_sum_count(scores, uid)
    centered = scores - total / count
    if scale_by_std:
        squares, _ = ops.group_sum_count(centered**2, uid)
        centered = centered / ((squares / (count - 1).clamp(min=1)).sqrt() + eps)
    return torch.where(count > 1, centered, torch.zeros_like(centered))


def _comb_ratio(top, bottom, k: int):
    """C(top, k) / C(bottom, k) elementwise for 0 <= top <= bottom (float64 tensors).

    = top! (bottom - k)! / ((top - k)! bottom!), through log-gamma; 0 where top < k.
    """
    safe = top.clamp(min=k)
    log_ratio = (
        torch.lgamma(safe + 1)
        - torch.lgamma(safe - k + 1)
        - torch.lgamma(bottom + 1)
        + torch.lgamma(bottom - k + 1)
    )
    return torch.where(top >= k, torch.exp(log_ratio), torch.zeros_like(log_ratio))


def passk_advantages(scores, uid, k: int):
    """Advantages of the pass@k objective, in closed form (Chen et al., "Pass@k Training for
    Adaptively Balancing Exploration and Exploitation of Large Reasoning Models", arXiv
    2508.10751, Eqs. 14-15).

    Think of every k-subset of a group of N responses as one "group" whose reward is 1 if any
    member is correct (pass@k), normalise those rewards GRPO-style over all subsets, and give
    each response the mean advantage of the subsets it belongs to. With N_neg wrong answers:
        mean R = 1 - C(N_neg, k) / C(N, k),  std = sqrt(R (1 - R)),
        A_pos = (1 - R) / std,
        A_neg = (1 - R - C(N_neg - 1, k - 1) / C(N - 1, k - 1)) / std.
    A group with std 0 (all right, all wrong, or fewer than k wrong) gets 0. k = 1 is GRPO
    with the population std. Not verl's `grpo_passk` (arXiv 2503.19595: best minus second best).

    Args:
        scores: (b,) rewards in {0, 1}.
        uid: (b,) group ids.
        k: samples per pass@k attempt; every group needs at least k rows.

    Returns:
        (b,) float advantages.
    """
    correct = scores.double()
    if not bool(((correct == 0) | (correct == 1)).all()):
        raise ValueError("pass@k advantages need binary scores (0 or 1)")
    n_correct, n = ops.group_sum_count(correct, uid)
    n_correct, n = n_correct.double(), n.double()
    if bool((n < k).any()):
        raise ValueError(f"pass@k with k={k} needs groups of at least {k} rows; got {int(n.min())}")
    n_wrong = n - n_correct
    mean = 1 - _comb_ratio(n_wrong, n, k)
    std = (mean * (1 - mean)).clamp(min=0).sqrt()
    all_wrong_with_me = _comb_ratio(n_wrong - 1, n - 1, k - 1)  # share of my subsets that fail
    numerator = torch.where(correct == 1, 1 - mean, 1 - mean - all_wrong_with_me)
    adv = torch.where(std > 0, numerator / std.clamp(min=1e-12), torch.zeros_like(std))
    return adv.float()


def opo_advantages(scores, uid, response_mask):
    """OPO: the optimal baseline is the length-weighted mean reward of the group (Hao et al.,
    "On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585).

    b = sum_j |y_j| r_j / sum_j |y_j| over the group, A_i = r_i - b. For exact on-policy
    training, where the gradient norm grows with the response length, this baseline minimises
    the gradient variance. A group of one gets 0 (b = its own score; verl uses b = 0 there).

    Args:
        scores: (b,) rewards.
        uid: (b,) group ids.
        response_mask: (b, t); the row sums are the lengths |y_i|.

    Returns:
        (b,) float advantages.
    """
    scores = scores.float()
    lengths = response_mask.float().sum(-1)  # (b,)
    weighted, _ = ops.group_sum_count(lengths * scores, uid)
    total_length, _ = ops.group_sum_count(lengths, uid)
    return scores - weighted / total_length.clamp(min=1)


def gpg_advantages(scores, uid, scale_by_std: bool = False, eps: float = 1e-6):
    """GPG's group advantage with its gradient correction (Chu et al., "GPG: A Simple and
    Strong Reinforcement Learning Baseline for Model Reasoning", arXiv 2504.02546).

    A_i = alpha (r_i - mean of its group) / F_norm with alpha = B / (B - M): B rows in the
    batch, M of them in groups whose rewards are all equal (their advantage is 0, so they add
    no gradient and would otherwise shrink the mean). F_norm is 1, or the group's (unbiased)
    std + eps with `scale_by_std`. verl's `gpg` estimator divides B by the number of rows
    with a non-zero score instead of B - M; this follows the paper.

    Args:
        scores: (b,) rewards.
        uid: (b,) group ids.
        scale_by_std: divide by the group's std (F_norm = std + eps).
        eps: added to the std.

    Returns:
        (b,) float advantages.
    """
    scores = scores.float()
    centred = group_advantages(scores, uid, scale_by_std, eps)
    index, groups = ops.group_ids(uid)
    highest = torch.full((groups,), -torch.inf).scatter_reduce(0, index, scores, "amax")
    lowest = torch.full((groups,), torch.inf).scatter_reduce(0, index, scores, "amin")
    valid = (highest != lowest)[index]  # rows of groups whose rewards differ
    alpha = len(scores) / max(int(valid.sum()), 1)
    return torch.where(valid, alpha * centred, torch.zeros_like(centred))
