"""GPG's group advantages (Chu et al., "GPG: A Simple and Strong Reinforcement Learning
Baseline for Model Reasoning", arXiv 2504.02546): GRPO's centred scores, scaled by
alpha = B / (B - M) so that the M rows of all-equal groups do not dilute the gradient.

reads: scores, uid, response_mask -> writes: advantages
Pair it with update.policy's `loss = "gpg"` (the plain policy gradient). The math is
`flowrl.math.estimators.gpg_advantages`.
"""

from __future__ import annotations

import attrs

from flowrl.math import estimators
from flowrl.nodespec import NodeSpec
from flowrl.params import checked, positive


@attrs.frozen
class Params:
    scale_by_std: bool = False  # divide by the group's std + eps (the paper's F_norm = 1: off)
    eps: float = checked(1e-6, positive())  # added to the std


def run(batch, params):
    estimators.refuse_shared_episodes(batch, "gpg")
    adv = estimators.gpg_advantages(batch["scores"], batch["uid"], params.scale_by_std, params.eps)
    return {"advantages": adv[:, None] * batch["response_mask"]}  # (b, t)


SPEC = NodeSpec(
    reads=("scores", "uid", "response_mask"),
    writes=("advantages",),
    params=Params,
    fn=run,
    groups=True,
    reads_if_written=("episode_share",),  # to refuse it: see run
)
