"""Group-relative advantages (GRPO, arXiv 2402.03300); Dr. GRPO without the std (2503.20783).
The math is `flowrl.math.estimators.group_advantages`.

reads: scores, uid, response_mask (+ episode_share when written) -> writes: advantages
"""

from __future__ import annotations

import attrs

from flowrl.math import estimators
from flowrl.nodespec import NodeSpec
from flowrl.params import checked, positive


@attrs.frozen
class Params:
    scale_by_std: bool = True  # False gives Dr. GRPO
    eps: float = checked(1e-6, positive())  # added to the group's std


def run(batch, params):
    share = batch["episode_share"] if "episode_share" in batch.keys() else None
    adv = estimators.group_advantages(
        batch["scores"], batch["uid"], params.scale_by_std, params.eps, share
    )
    return {"advantages": adv[:, None] * batch["response_mask"]}  # (b, t)


SPEC = NodeSpec(
    reads=("scores", "uid", "response_mask"),
    writes=("advantages",),
    params=Params,
    fn=run,
    groups=True,
    # an agent program's episodes held in several rows (agent_program's max_segments)
    reads_if_written=("episode_share",),
)
