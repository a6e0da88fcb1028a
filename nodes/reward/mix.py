"""A weighted sum of two per-sequence scores: a reward model's and a rule's, say.

reads: rm_scores, rule_scores -> writes: scores
scores = rm_weight * rm_scores + rule_weight * rule_scores. Rename the reads to whichever two
keys a graph has (`rename = { rm_scores = "...", rule_scores = "..." }`). A reward model's
scores have no fixed scale (a Bradley-Terry model is defined up to a constant and is often
within +-1 of it), so weigh them against the rule's 0 / 1 with that in mind; `rm_center`
subtracts the batch mean of the reward model's scores first, which removes the constant.
"""

from __future__ import annotations

import attrs

from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    rm_weight: float = 1.0  # weight of rm_scores
    rule_weight: float = 1.0  # weight of rule_scores
    rm_center: bool = False  # subtract the batch mean of rm_scores first


def mixed_scores(rm_scores, rule_scores, rm_weight: float, rule_weight: float, rm_center: bool):
    """rm_scores, rule_scores (b,) -> (b,): the weighted sum (rm_scores centred if asked)."""
    rm = rm_scores.float()
    if rm_center and len(rm):
        rm = rm - rm.mean()
    return rm_weight * rm + rule_weight * rule_scores.float()


def run(batch, params):
    scores = mixed_scores(
        batch["rm_scores"],
        batch["rule_scores"],
        params.rm_weight,
        params.rule_weight,
        params.rm_center,
    )
    return {"scores": scores}, {"score": float(scores.mean()) if len(scores) else 0.0}


SPEC = NodeSpec(reads=("rm_scores", "rule_scores"), writes=("scores",), params=Params, fn=run)
