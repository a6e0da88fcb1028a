"""REINFORCE leave-one-out (RLOO, Ahmadian et al., arXiv 2402.14740); the math is
`flowrl.math.estimators.leave_one_out_advantages`.

reads: scores, uid, response_mask (+ episode_share when written) -> writes: advantages
"""

from __future__ import annotations

import attrs

from flowrl.math import estimators
from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    pass


def run(batch, params):
    share = batch["episode_share"] if "episode_share" in batch.keys() else None
    adv = estimators.leave_one_out_advantages(batch["scores"], batch["uid"], share)
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
