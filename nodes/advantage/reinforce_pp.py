"""REINFORCE++ (Hu et al., arXiv 2501.03262): discounted token returns, whitened over the
batch; `baseline = "group"` gives REINFORCE++-baseline instead, as verl computes it.

reads: token_rewards, response_mask (+ uid for the group baseline) -> writes: advantages, returns
REINFORCE++-baseline (verl's `reinforce_plus_plus_baseline`): each row's total reward minus its
group's mean total, the same on every token (no return-to-go, no discount: gamma must be 1),
whitened over the batch. A group of one sample keeps its total (its baseline is 0, as verl).
The math is in `flowrl.math.estimators` (`discounted_returns`, `baseline_advantages`).
"""

from __future__ import annotations

import attrs

from flowrl.hooks import Finding
from flowrl.math import estimators, ops
from flowrl.nodespec import NodeSpec
from flowrl.params import checked, interval, one_of

BASELINES = ("none", "group")


@attrs.frozen
class Params:
    gamma: float = checked(1.0, interval(0, 1))  # discount of the return-to-go (baseline "none")
    baseline: str = checked("none", one_of(BASELINES))  # "group": REINFORCE++-baseline


def run(batch, params):
    mask = batch["response_mask"]
    if params.baseline == "group":
        adv = estimators.baseline_advantages(batch["token_rewards"], mask, batch["uid"])
        totals = (batch["token_rewards"] * mask).sum(-1)
        return {"advantages": adv, "returns": totals[:, None] * mask}
    returns = estimators.discounted_returns(batch["token_rewards"], mask, params.gamma)
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
