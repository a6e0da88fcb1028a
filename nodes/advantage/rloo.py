"""REINFORCE leave-one-out (RLOO, Ahmadian et al., arXiv 2402.14740); the math is
`flowrl.math.estimators.leave_one_out_advantages`.

reads: scores, uid, response_mask -> writes: advantages
"""

from __future__ import annotations

import attrs

from flowrl.math import estimators
from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    pass


def run(batch, params):
    adv = estimators.leave_one_out_advantages(batch["scores"], batch["uid"])
    return {"advantages": adv[:, None] * batch["response_mask"]}  # (b, t)


SPEC = NodeSpec(
    reads=("scores", "uid", "response_mask"),
    writes=("advantages",),
    params=Params,
    fn=run,
    groups=True,
)
