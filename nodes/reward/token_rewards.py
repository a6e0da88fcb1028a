"""Sequence scores as token rewards, no reference model: the score on the last trained token.

reads: scores, response_mask -> writes: token_rewards
For estimators that take per-token rewards (advantage.reinforce_pp, advantage.remax, gae)
when the KL to the reference is a loss term (update.policy's kl_loss_coef) rather than a
reward: reward.kl_penalty with kl_coef = 0 gives the same rewards but needs old and reference
log-probs. The last trained token is the last 1 of response_mask (after any tool output).
"""

from __future__ import annotations

import attrs

from flowrl.lazy import torch
from flowrl.math import ops
from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    scale: float = 1.0  # multiply the scores


def last_token_rewards(scores, response_mask, scale: float = 1.0):
    """scores (b,), response_mask (b, t) -> (b, t): scale * score at each row's last trained
    token, 0 elsewhere (and on rows with no trained token)."""
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
    if response_mask.shape[-1] == 0:
        return rewards
    has_tokens = (response_mask.sum(-1) > 0).float()
    rows = torch.arange(len(scores))
    rewards[rows, ops.last_one(response_mask)] = scale * scores.float() * has_tokens
    return rewards


def run(batch, params):
    rewards = last_token_rewards(batch["scores"], batch["response_mask"], params.scale)
    return {"token_rewards": rewards}  # (b, t)


SPEC = NodeSpec(
    reads=("scores", "response_mask"),
    writes=("token_rewards",),
    params=Params,
    fn=run,
)
