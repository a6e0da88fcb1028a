"""REINFORCE++ (Hu et al., arXiv 2501.03262): discounted token returns, whitened over the
batch; `baseline = "group"` first subtracts each prompt's mean reward (REINFORCE++-baseline).

reads: token_rewards, response_mask (+ uid for the group baseline) -> writes: advantages, returns
"""

from __future__ import annotations

import attrs

from flowrl import ops
from flowrl.lazy import torch
from flowrl.nodespec import NodeSpec
from flowrl.validators import checked, interval, one_of


@attrs.frozen
class Params:
    gamma: float = checked(1.0, interval(0, 1))  # discount of the return-to-go
    baseline: str = checked("none", one_of(("none", "group")))  # "group": subtract the group mean


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


def run(batch, params):
    mask = batch["response_mask"]
    returns = discounted_returns(batch["token_rewards"], mask, params.gamma)
    shifted = returns
    if params.baseline == "group":
        baseline = group_baseline(batch["token_rewards"], mask, batch["uid"])
        shifted = (returns - baseline[:, None]) * mask
    return {"advantages": ops.masked_whiten(shifted, mask) * mask, "returns": returns}


SPEC = NodeSpec(
    reads=("token_rewards", "response_mask"),
    writes=("advantages", "returns"),
    params=Params,
    fn=run,
    optional_reads={"uid": lambda p: p.baseline == "group"},
)
