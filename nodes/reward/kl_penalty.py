"""KL-penalised token rewards (Ziegler et al., arXiv 1909.08593; as in PPO-RLHF).

reads: scores, old_logprobs, ref_logprobs, response_mask -> writes: token_rewards
r_t = -beta * KL_t on every token, plus the sequence score on its last token (the last 1 of
response_mask: the last sampled token). beta is fixed or adapted each step toward a target KL
(`kl_input`: verl's per-token mean by default). Metrics: kl (per sequence, summed over its
tokens), kl_token_mean (per token) and kl_coef.
"""

from __future__ import annotations

import attrs

from flowrl.hooks import Finding
from flowrl.lazy import torch
from flowrl.math import components, ops
from flowrl.nodespec import NodeSpec
from flowrl.params import at_least, checked, count, one_of, positive

# what the adaptive controller compares with target_kl: each row's mean KL per trained token,
# averaged over rows (verl's input, so verl's target_kl = 0.1 carries over), or each row's
# summed KL averaged over rows (Ziegler et al.'s per-sequence KL, target ~ 6 nats)
KL_INPUTS = ("token-mean", "seq-sum")


@attrs.frozen
class Params:
    kl_coef: float = checked(0.001, at_least(0))  # beta (the adaptive controller's start)
    kl_kind: str = checked("k1", components.KNOWN_KL)  # KL estimator
    controller: str = checked("fixed", one_of(("fixed", "adaptive")))  # how beta evolves
    kl_input: str = checked("token-mean", one_of(KL_INPUTS))  # adaptive: KL per token or per row
    target_kl: float = checked(0.1, positive())  # adaptive: the KL to steer toward (verl's)
    horizon: int = checked(10000, count(1))  # adaptive: how fast beta moves (in rows)


def next_kl_coef(coef: float, current_kl: float, rows: int, params) -> float:
    """The fixed controller keeps beta; the adaptive one (Ziegler et al. 2019) moves it:
    beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * rows / horizon."""
    if params.controller == "fixed":
        return coef
    error = min(max(current_kl / params.target_kl - 1, -0.2), 0.2)
    return coef * (1 + error * rows / params.horizon)


def kl_token_rewards(scores, logprobs, ref_logprobs, response_mask, kl_coef, kind):
    """(b,), (b, t) x3 -> token_rewards (b, t) and the per-row KL (b,); `kind` a built-in KL
    kind's name or a function kl(logprobs, ref_logprobs) -> (b, t)."""
    mask = response_mask.to(logprobs.dtype)
    estimate = kind if callable(kind) else components.kl_function(kind)
    kl = estimate(logprobs, ref_logprobs) * mask  # (b, t)
    rewards = -kl_coef * kl
    last = ops.last_one(response_mask)  # (b,): the last trained token, after any hole
    has_tokens = (mask.sum(-1) > 0).to(rewards.dtype)
    rewards[torch.arange(len(scores)), last] += scores.float() * has_tokens
    return rewards, kl.sum(-1)


def run(batch, params, state):
    coef = state.setdefault("kl_coef", params.kl_coef)  # kept across steps and checkpoints
    kind = components.kl_function(params.kl_kind, batch.meta.get("base_dir", "."))
    rewards, kl = kl_token_rewards(
        batch["scores"],
        batch["old_logprobs"],
        batch["ref_logprobs"],
        batch["response_mask"],
        coef,
        kind,
    )
    lengths = batch["response_mask"].sum(-1).clamp(min=1)  # (b,)
    seq_sum = float(kl.mean()) if len(kl) else 0.0
    token_mean = float((kl / lengths).mean()) if len(kl) else 0.0
    current = token_mean if params.kl_input == "token-mean" else seq_sum
    state["kl_coef"] = next_kl_coef(coef, current, len(kl), params)
    return {"token_rewards": rewards}, {"kl": seq_sum, "kl_token_mean": token_mean, "kl_coef": coef}


def check(params: Params, context) -> list[Finding]:
    """A KL kind by reference must load and take (logprobs, ref_logprobs)."""
    try:
        components.kl_function(params.kl_kind, context.base_dir)
    except components.ComponentError as e:
        return [Finding(e.message, e.fix)]
    return []


SPEC = NodeSpec(
    reads=("scores", "old_logprobs", "ref_logprobs", "response_mask"),
    writes=("token_rewards",),
    params=Params,
    fn=run,
    stateful=True,
    check=check,
)
