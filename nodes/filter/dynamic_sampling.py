"""DAPO dynamic sampling (Yu et al., arXiv 2503.14476): drop groups whose samples all scored
the same, since their group-relative advantages are zero and teach nothing.

reads: scores, uid -> keeps rows (a filter: the runtime drops the others)
With `min_groups > 0` the step refills, as verl's `filter_groups`: the controller samples
further prompt batches (running every node before this one again) until this node has kept
`min_groups` groups or `max_rounds` batches are spent (verl's `max_num_gen_batches`), then
trains on the first `min_groups` groups kept. Where verl stops the run when the batches run
out, this trains on the groups it has (the metric refill/groups says how many).
"""

from __future__ import annotations

import attrs

from flowrl.hooks import Finding, Refill
from flowrl.lazy import torch
from flowrl.math import ops
from flowrl.nodespec import NodeSpec
from flowrl.params import MAX_ROWS, checked, count


@attrs.frozen
class Params:
    min_groups: int = checked(0, count(0, MAX_ROWS))  # refill to this many groups; 0 = no refill
    max_rounds: int = checked(4, count(1, 1000))  # refill: the most prompt batches a step samples


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


def check(params: Params, context) -> list[Finding]:
    most = context.prompts * params.max_rounds
    if params.min_groups > most:
        return [
            Finding(
                f"min_groups = {params.min_groups} can never be reached: {params.max_rounds} "
                f"prompt batches of {context.prompts} prompts hold {most} groups",
                f"set min_groups <= {most}, or raise max_rounds or data.batch_size",
            )
        ]
    return []


SPEC = NodeSpec(
    reads=("scores", "uid"),
    writes=(),
    params=Params,
    fn=run,
    rows="filter",
    groups=True,
    check=check,
    refill=Refill(groups="min_groups", rounds="max_rounds"),
)
