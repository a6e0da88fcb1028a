"""Advantage estimators as pure functions: every formula of the nodes under nodes/advantage/,
each tested against a plain reference loop (tests/unit/nodes/test_advantage_nodes.py,
tests/unit/math/test_estimators.py).

Token-level estimators map per-token rewards (b, t) to advantages and returns (b, t): GAE
(arXiv 1506.02438), REINFORCE++'s discounted returns and its group baseline (arXiv 2501.03262),
ReMax (arXiv 2310.10505). Group estimators map per-row scores (b,) and group ids `uid` (b,)
(rows sampled from the same prompt share one) to per-row advantages (b,), which a node
broadcasts over the response tokens as `adv[:, None] * response_mask`: GRPO's (arXiv
2402.03300), RLOO's (arXiv 2402.14740), pass@k (arXiv 2508.10751), OPO (arXiv 2505.23585) and
GPG's corrected group advantage (arXiv 2504.02546). A node module holds its params, the call
and its spec (docs/extending.md, "Where the math lives").
"""

from __future__ import annotations

from flowrl.lazy import torch
from flowrl.math import ops

# -- group estimators: per-row scores (b,) and group ids (b,) -> (b,) ---------------------------


def group_advantages(scores, uid, scale_by_std: bool = True, eps: float = 1e-6, share=None):
    """scores (b,), uid (b,) -> (b,): score minus its group's mean [/ (group std + eps)].

    Groups of one sample get 0 (no baseline to compare with). `share` (b,): each row's share of
    its episode (an episode of an agent program held in several rows, every row with the
    episode's score: 1 / its rows): the group's mean and std are then the episodes', as if
    each were one row.
    """
    scores = scores.float()
    if share is not None:
        return _shared_group_advantages(scores, uid, scale_by_std, eps, share.float())
    total, count = ops.group_sum_count(scores, uid)
    centered = scores - total / count
    if scale_by_std:
        squares, _ = ops.group_sum_count(centered**2, uid)
        centered = centered / ((squares / (count - 1).clamp(min=1)).sqrt() + eps)
    return torch.where(count > 1, centered, torch.zeros_like(centered))


def _shared_group_advantages(scores, uid, scale_by_std, eps, share):
    """group_advantages over episodes whose rows carry `share` of them (weights summing to 1
    per episode): the weighted mean and the weighted unbiased std over episodes."""
    total, _ = ops.group_sum_count(share * scores, uid)
    episodes, _ = ops.group_sum_count(share, uid)
    centered = scores - total / episodes
    if scale_by_std:
        squares, _ = ops.group_sum_count(share * centered**2, uid)
        centered = centered / ((squares / (episodes - 1).clamp(min=1)).sqrt() + eps)
    return torch.where(episodes > 1 + 1e-4, centered, torch.zeros_like(centered))


def leave_one_out_advantages(scores, uid, share=None):
    """scores (b,), uid (b,) -> (b,): score minus the mean of the OTHER samples of its group.

    With k samples: A_i = s_i - (sum_j s_j - s_i) / (k - 1); groups of one get 0. `share`
    (b,): each row's share of its episode (see group_advantages): the other samples are the
    other episodes.
    """
    scores = scores.float()
    if share is not None:
        share = share.float()
        total, _ = ops.group_sum_count(share * scores, uid)
        episodes, _ = ops.group_sum_count(share, uid)
        baseline = (total - scores) / (episodes - 1).clamp(min=1)
        return torch.where(episodes > 1 + 1e-4, scores - baseline, torch.zeros_like(scores))
    total, count = ops.group_sum_count(scores, uid)
    baseline = (total - scores) / (count - 1).clamp(min=1)
    return torch.where(count > 1, scores - baseline, torch.zeros_like(scores))


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


# -- token-level estimators: per-token rewards (b, t) -> (b, t) ------------------------------


def gae_advantages(token_rewards, values, response_mask, gamma: float, lam: float):
    """(b, t) each -> advantages, returns (b, t).

    delta_t = r_t + gamma V_{t+1} - V_t;  A_t = delta_t + gamma lam A_{t+1}; returns = A + V.
    The recursion runs over the positions where response_mask is 1, so t+1 is the next such
    position: a 0 inside a row (tool output in a multi-turn row) is skipped, its reward and
    value unused, and V and A are carried across it (verl's convention). Past a row's last
    token V and A count as 0; advantages and returns are 0 where the mask is 0.
    """
    mask = response_mask.to(values.dtype)
    trained = response_mask.bool()
    values = values * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros(values.shape[0])
    next_value = torch.zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(trained[:, t], delta + gamma * lam * running, running)
        next_value = torch.where(trained[:, t], values[:, t], next_value)
        advantages[:, t] = running * mask[:, t]
    return advantages, (advantages + values) * mask


def discounted_returns(token_rewards, response_mask, gamma: float):
    """(b, t) -> (b, t): G_t = r_t + gamma G_{t+1}, zero where response_mask is 0.

    t+1 is the next position where the mask is 1: a 0 inside a row (tool output in a
    multi-turn row) is skipped, its reward unused, and the return carried across it.
    """
    mask = response_mask.to(token_rewards.dtype)
    trained = response_mask.bool()
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0])
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(trained[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running * mask[:, t]
    return returns


def group_baseline(token_rewards, response_mask, uid):
    """(b,): the mean total reward of each row's group."""
    totals = (token_rewards * response_mask.to(token_rewards.dtype)).sum(-1)
    total, count = ops.group_sum_count(totals, uid)
    return total / count


def baseline_advantages(token_rewards, response_mask, uid):
    """(b, t) x2, uid (b,) -> (b, t): (row total - group mean) on every trained token, whitened
    over the batch's trained tokens (verl's REINFORCE++-baseline). A group of one sample has
    baseline 0, so its row keeps its total (where GRPO and RLOO give it 0)."""
    mask = response_mask.to(token_rewards.dtype)
    totals = (token_rewards * mask).sum(-1)  # (b,)
    _, count = ops.group_sum_count(totals, uid)
    baseline = torch.where(count > 1, group_baseline(token_rewards, response_mask, uid), 0.0)
    shifted = (totals - baseline)[:, None] * mask
    return ops.masked_whiten(shifted, mask) * mask


def remax_advantages(scores, baseline_scores, response_mask):
    """(b,), (b,), (b, t) -> (b, t): score - greedy score on every response token (the
    outcome-only case of `remax_return_advantages`)."""
    return (scores.float() - baseline_scores.float())[:, None] * response_mask


def remax_return_advantages(token_rewards, baseline_scores, response_mask):
    """(b, t), (b,), (b, t) -> (b, t): reward-to-go minus the greedy score, on trained tokens.

    G_t = sum_{s >= t, mask_s = 1} r_s (undiscounted; rewards under mask 0 are not counted).
    """
    mask = response_mask.to(token_rewards.dtype)
    returns = torch.flip(torch.cumsum(torch.flip(token_rewards * mask, [-1]), -1), [-1])
    return (returns - baseline_scores.float()[:, None]) * mask


def refuse_shared_episodes(batch, node: str) -> None:
    """ValueError for an advantage node whose statistics take one row per episode, when an
    agent program holds its episodes in several rows (`episode_share` written)."""
    if "episode_share" in batch.keys():
        raise ValueError(
            f"advantage.{node} takes one row per episode, and an agent program holds its "
            "episodes in several rows (max_segments > 1): use advantage.grpo or advantage.rloo "
            "(they take group statistics over episodes), or max_segments = 1"
        )
