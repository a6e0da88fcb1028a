"""REINFORCE leave-one-out (RLOO, Ahmadian et al., arXiv 2402.14740).

reads: scores, uid, response_mask -> writes: advantages
"""

from __future__ import annotations

import attrs

from flowrl.lazy import torch
from flowrl.math import ops
from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    pass


def leave_one_out_advantages(scores, uid):
    """scores (b,), uid (b,) -> (b,): score minus the mean of the OTHER samples of its group.

    With k samples: A_i = s_i - (sum_j s_j - s_i) / (k - 1); groups of one get 0.
    """
    scores = scores.float()
    total, count = ops.group_sum_count(scores, uid)
    baseline = (total - scores) / (count - 1).clamp(min=1)
    return torch.where(count > 1, scores - baseline, torch.zeros_like(scores))


def run(batch, params):
    adv = leave_one_out_advantages(batch["scores"], batch["uid"])
    return {"advantages": adv[:, None] * batch["response_mask"]}  # (b, t)


SPEC = NodeSpec(
    reads=("scores", "uid", "response_mask"),
    writes=("advantages",),
    params=Params,
    fn=run,
    groups=True,
)
