"""ReMax (Li et al., arXiv 2310.10505): the greedy response's score is the baseline.

reads: scores, baseline_scores, response_mask -> writes: advantages, returns
"""

from __future__ import annotations

import attrs

from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    pass


def remax_advantages(scores, baseline_scores, response_mask):
    """(b,), (b,), (b, t) -> (b, t): score - greedy score on every response token."""
    return (scores.float() - baseline_scores.float())[:, None] * response_mask


def run(batch, params):
    adv = remax_advantages(batch["scores"], batch["baseline_scores"], batch["response_mask"])
    return {"advantages": adv, "returns": adv}


SPEC = NodeSpec(
    reads=("scores", "baseline_scores", "response_mask"),
    writes=("advantages", "returns"),
    params=Params,
    fn=run,
)
