"""Generalized advantage estimation (Schulman et al., arXiv 1506.02438).

reads: token_rewards, values, response_mask -> writes: advantages, returns
"""

from __future__ import annotations

import attrs

from flowrl import ops
from flowrl.lazy import torch
from flowrl.nodespec import NodeSpec
from flowrl.validators import checked, interval


@attrs.frozen
class Params:
    gamma: float = checked(1.0, interval(0, 1))  # discount
    lam: float = checked(1.0, interval(0, 1))  # GAE lambda: 1 = Monte Carlo, 0 = one-step TD
    whiten: bool = True  # normalise advantages over the batch's tokens


def gae_advantages(token_rewards, values, response_mask, gamma: float, lam: float):
    """(b, t) each -> advantages, returns (b, t).

    delta_t = r_t + gamma V_{t+1} - V_t;  A_t = delta_t + gamma lam A_{t+1}; returns = A + V.
    Positions past a row's last token contribute nothing (V and A beyond it count as 0).
    """
    mask = response_mask.to(values.dtype)
    values = values * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros(values.shape[0])
    next_value = torch.zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        next_value = values[:, t]
        advantages[:, t] = running
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
