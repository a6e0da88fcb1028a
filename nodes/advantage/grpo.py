"""Group-relative advantages (GRPO, arXiv 2402.03300); Dr. GRPO without the std (2503.20783).

reads: scores, uid, response_mask -> writes: advantages
"""

from __future__ import annotations

import attrs

from flowrl import ops
from flowrl.lazy import torch
from flowrl.nodespec import NodeSpec
from flowrl.validators import checked, positive


@attrs.frozen
class Params:
    scale_by_std: bool = True  # False gives Dr. GRPO
    eps: float = checked(1e-6, positive())  # added to the group's std


def group_advantages(scores, uid, scale_by_std: bool = True, eps: float = 1e-6):
    """scores (b,), uid (b,) -> (b,): score minus its group's mean [/ (group std + eps)].

    Groups of one sample get 0 (no baseline to compare with).
    """
    scores = scores.float()
    total, count = ops.group_sum_count(scores, uid)
    centered = scores - total / count
    if scale_by_std:
        squares, _ = ops.group_sum_count(centered**2, uid)
        centered = centered / ((squares / (count - 1).clamp(min=1)).sqrt() + eps)
    return torch.where(count > 1, centered, torch.zeros_like(centered))


def run(batch, params):
    adv = group_advantages(batch["scores"], batch["uid"], params.scale_by_std, params.eps)
    return {"advantages": adv[:, None] * batch["response_mask"]}  # (b, t)


SPEC = NodeSpec(
    reads=("scores", "uid", "response_mask"),
    writes=("advantages",),
    params=Params,
    fn=run,
    groups=True,
)
