"""OPO advantages (Hao et al., "On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585):
the baseline is the group's mean score weighted by response length.

reads: scores, uid, response_mask -> writes: advantages
A_i = r_i - sum_j |y_j| r_j / sum_j |y_j| over the prompt's samples; meant for exactly
on-policy training (on_policy = true, one update per batch). The math is
`flowrl.math.estimators.opo_advantages`.
"""

from __future__ import annotations

import attrs

from flowrl.math import estimators
from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    pass


def run(batch, params):
    estimators.refuse_shared_episodes(batch, "opo")
    adv = estimators.opo_advantages(batch["scores"], batch["uid"], batch["response_mask"])
    return {"advantages": adv[:, None] * batch["response_mask"]}  # (b, t)


SPEC = NodeSpec(
    reads=("scores", "uid", "response_mask"),
    writes=("advantages",),
    params=Params,
    fn=run,
    groups=True,
    reads_if_written=("episode_share",),  # to refuse it: see run
)
