"""Generalized advantage estimation (Schulman et al., arXiv 1506.02438); the math is
`flowrl.math.estimators.gae_advantages`.

reads: token_rewards, values, response_mask -> writes: advantages, returns
"""

from __future__ import annotations

import attrs

from flowrl.math import estimators, ops
from flowrl.nodespec import NodeSpec
from flowrl.params import checked, interval


@attrs.frozen
class Params:
    gamma: float = checked(1.0, interval(0, 1))  # discount
    lam: float = checked(1.0, interval(0, 1))  # GAE lambda: 1 = Monte Carlo, 0 = one-step TD
    whiten: bool = True  # normalise advantages over the batch's tokens


def run(batch, params):
    adv, returns = estimators.gae_advantages(
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
