"""Pass@k advantages (Chen et al., "Pass@k Training ...", arXiv 2508.10751): reward each sample
for what it adds to the chance that one of k samples is right, in closed form.

reads: scores, uid, response_mask -> writes: advantages
Binary scores only (0 or 1); every prompt needs at least k samples. k = 1 is GRPO with the
population std. The math is `flowrl.math.estimators.passk_advantages`.
"""

from __future__ import annotations

import attrs

from flowrl.hooks import Finding
from flowrl.math import estimators
from flowrl.nodespec import NodeSpec
from flowrl.params import MAX_SAMPLES, checked, count


@attrs.frozen
class Params:
    k: int = checked(4, count(1, MAX_SAMPLES))  # samples per pass@k attempt; at most n


def run(batch, params):
    estimators.refuse_shared_episodes(batch, "passk")
    adv = estimators.passk_advantages(batch["scores"], batch["uid"], params.k)
    return {"advantages": adv[:, None] * batch["response_mask"]}  # (b, t)


def check(params: Params, context) -> list[Finding]:
    if params.k > context.samples:
        return [
            Finding(
                f"k = {params.k} needs k <= the {context.samples} samples of each prompt",
                f"set k <= {context.samples}, or raise n on the generate node",
            )
        ]
    return []


SPEC = NodeSpec(
    reads=("scores", "uid", "response_mask"),
    writes=("advantages",),
    params=Params,
    fn=run,
    groups=True,
    check=check,
    reads_if_written=("episode_share",),  # to refuse it: see run
)
