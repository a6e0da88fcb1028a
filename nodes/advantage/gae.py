"""Generalized advantage estimation (Schulman et al., arXiv 1506.02438).

reads: token_rewards, values, response_mask -> writes: advantages, returns
"""

from __future__ import annotations

import attrs

from flowrl.front.validators import checked, interval
from flowrl.lazy import torch
from flowrl.math import ops
from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    gamma: float = checked(1.0, interval(0, 1))  # discount
    lam: float = checked(1.0, interval(0, 1))  # GAE lambda: 1 = Monte Carlo, 0 = one-step TD
    whiten: bool = True  # normalise advantages over the batch's tokens


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


def run(batch, params):
    adv, returns = gae_advantages(
        batch["token_rewards"], batch["values"], batch["response_mask"], params.gamma, params.lam
    )
    if params.whiten:
        adv = ops.masked_whiten(adv, batch["response_mask"]) * batch["response_mask"]
    return {"advantages": adv, "returns": returns}


SPEC = NodeSpec(
    reads=("token_rewards", "values", "response_mask"),
    writes=("advantages", "returns"),
    params=Params,
    fn=run,
)
