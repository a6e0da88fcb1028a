"""KL-penalised token rewards (Ziegler et al., arXiv 1909.08593; as in PPO-RLHF).

reads: scores, old_logprobs, ref_logprobs, response_mask -> writes: token_rewards
r_t = -beta * KL_t on every token, plus the sequence score on its last token (the last 1 of
response_mask: the last sampled token). beta is fixed or adapted each step toward a target KL.
"""

from __future__ import annotations

import attrs

from flowrl import ops
from flowrl.lazy import torch
from flowrl.nodespec import NodeSpec
from flowrl.validators import at_least, checked, count, one_of, positive


@attrs.frozen
class Params:
    kl_coef: float = checked(0.001, at_least(0))  # beta (the adaptive controller's start)
    kl_kind: str = checked("k1", one_of(ops.KL_KINDS))  # KL estimator
    controller: str = checked("fixed", one_of(("fixed", "adaptive")))  # how beta evolves
    target_kl: float = checked(6.0, positive())  # adaptive: the KL per sequence to steer toward
    horizon: int = checked(10000, count(1))  # adaptive: how fast beta moves (in rows)


class FixedKLController:
    def __init__(self, coef: float):
        self.value = coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon (Ziegler et al. 2019)."""

    def __init__(self, coef: float, target: float, horizon: int):
        self.value, self.target, self.horizon = coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


def kl_token_rewards(scores, logprobs, ref_logprobs, response_mask, kl_coef, kind):
    """(b,), (b, t) x3 -> token_rewards (b, t) and the per-row KL (b,)."""
    mask = response_mask.to(logprobs.dtype)
    kl = ops.kl_estimate(logprobs, ref_logprobs, kind) * mask  # (b, t)
    rewards = -kl_coef * kl
    last = ops.last_one(response_mask)  # (b,): the last trained token, after any hole
    has_tokens = (mask.sum(-1) > 0).to(rewards.dtype)
    rewards[torch.arange(len(scores)), last] += scores.float() * has_tokens
    return rewards, kl.sum(-1)


def run(batch, params, state):
    if "controller" not in state:
        state["controller"] = (
            FixedKLController(params.kl_coef)
            if params.controller == "fixed"
            else AdaptiveKLController(params.kl_coef, params.target_kl, params.horizon)
        )
    controller = state["controller"]
    coef = controller.value
    rewards, kl = kl_token_rewards(
        batch["scores"],
        batch["old_logprobs"],
        batch["ref_logprobs"],
        batch["response_mask"],
        coef,
        params.kl_kind,
    )
    mean_kl = float(kl.mean()) if len(kl) else 0.0
    controller.update(mean_kl, len(kl))
    return {"token_rewards": rewards}, {"kl": mean_kl, "kl_coef": coef}


SPEC = NodeSpec(
    reads=("scores", "old_logprobs", "ref_logprobs", "response_mask"),
    writes=("token_rewards",),
    params=Params,
    fn=run,
    stateful=True,
)
