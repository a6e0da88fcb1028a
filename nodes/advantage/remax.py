"""ReMax (Li et al., arXiv 2310.10505): the greedy response's score is the baseline.

reads: token_rewards, baseline_scores, response_mask -> writes: advantages, returns
As verl: A_t = (sum of the row's token rewards from t on) - the greedy score, so a KL penalty
in the reward (reward.kl_penalty) counts only from each token on; with the score alone on the
last token (reward.token_rewards) every token gets score - greedy score. `baseline_scores`
comes from a second, greedy generate node scored by a second reward node (graphs/remax.toml).
The math is `flowrl.math.estimators.remax_return_advantages`.
"""

from __future__ import annotations

import attrs

from flowrl.math import estimators
from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    pass


def run(batch, params):
    adv = estimators.remax_return_advantages(
        batch["token_rewards"], batch["baseline_scores"], batch["response_mask"]
    )
    return {"advantages": adv, "returns": adv}


SPEC = NodeSpec(
    reads=("token_rewards", "baseline_scores", "response_mask"),
    writes=("advantages", "returns"),
    params=Params,
    fn=run,
)
