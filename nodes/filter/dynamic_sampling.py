"""DAPO dynamic sampling (Yu et al., arXiv 2503.14476): drop groups whose samples all scored
the same, since their group-relative advantages are zero and teach nothing.

reads: scores, uid -> keeps rows (a filter: the runtime drops the others)
"""

from __future__ import annotations

import attrs

from flowrl import ops
from flowrl.lazy import torch
from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    pass


def varied_groups(scores, uid):
    """scores (b,), uid (b,) -> keep (b,) bool: rows of groups whose scores are not all equal."""
    index, groups = ops.group_ids(uid)
    scores = scores.float()
    high = torch.full((groups,), float("-inf")).scatter_reduce(0, index, scores, "amax")
    low = torch.full((groups,), float("inf")).scatter_reduce(0, index, scores, "amin")
    return (high > low)[index]


def run(batch, params):
    keep = varied_groups(batch["scores"], batch["uid"])
    return {"keep": keep}, {"kept_fraction": float(keep.float().mean()) if len(keep) else 0.0}


SPEC = NodeSpec(
    reads=("scores", "uid"), writes=(), params=Params, fn=run, rows="filter", groups=True
)
