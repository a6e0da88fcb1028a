"""REINFORCE++ (Hu et al., arXiv 2501.03262): discounted token returns, whitened over the
batch; `baseline = "group"` gives REINFORCE++-baseline instead, as verl computes it.

reads: token_rewards, response_mask (+ uid for the group baseline) -> writes: advantages, returns
REINFORCE++-baseline (verl's `reinforce_plus_plus_baseline`): each row's total reward minus its
group's mean total, the same on every token (no return-to-go, no discount: gamma must be 1),
whitened over the batch. A group of one sample keeps its total (its baseline is 0, as verl).
"""

from __future__ import annotations

import attrs

from flowrl.front.validators import checked, interval, one_of
from flowrl.lazy import torch
from flowrl.math import ops
from flowrl.nodespec import Finding, NodeSpec

BASELINES = ("none", "group")


@attrs.frozen
class Params:
    gamma: float = checked(1.0, interval(0, 1))  # discount of the return-to-go (baseline "none")
    baseline: str = checked("none", one_of(BASELINES))  # "group": REINFORCE++-baseline


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


def run(batch, params):
    mask = batch["response_mask"]
    if params.baseline == "group":
        adv = baseline_advantages(batch["token_rewards"], mask, batch["uid"])
        totals = (batch["token_rewards"] * mask).sum(-1)
        return {"advantages": adv, "returns": totals[:, None] * mask}
    returns = discounted_returns(batch["token_rewards"], mask, params.gamma)
    return {"advantages": ops.masked_whiten(returns, mask) * mask, "returns": returns}


def check(params: Params, context) -> list[Finding]:
    if params.baseline == "group" and params.gamma != 1.0:
        return [
            Finding(
                'REINFORCE++-baseline (baseline = "group") scores whole sequences, so it '
                "does not discount",
                'remove gamma (1.0), or use baseline = "none" for discounted returns',
            )
        ]
    return []


SPEC = NodeSpec(
    reads=("token_rewards", "response_mask"),
    writes=("advantages", "returns"),
    params=Params,
    fn=run,
    optional_reads={"uid": lambda p: p.baseline == "group"},
    check=check,
)
