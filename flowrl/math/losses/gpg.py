"""GPG: the plain policy gradient, no ratio, no clip (Chu et al., "GPG: A Simple and Strong
Reinforcement Learning Baseline for Model Reasoning", arXiv 2504.02546).

Signature and conventions: `flowrl.math.losses.base`.
"""

from __future__ import annotations

from flowrl.math.losses.base import Chunk


def gpg_loss(logprobs, old_logprobs, advantages, response_mask, params, chunk: Chunk):
    """-A log pi per trained token; (b, t) inputs -> (loss, no rates). `old_logprobs` unused.

    Loss = -sum_i,t A_i,t log pi(y_i,t) / sum_i |y_i| with agg = "token-mean". GPG's
    correction of the advantages (alpha = B / (B - M) for the M rows of zero-variance groups)
    is in `flowrl.math.estimators.gpg_advantages`. Strictly on-policy: every step samples
    afresh.
    """
    mask = response_mask.to(logprobs.dtype)
    loss = chunk.weighted(-advantages * logprobs)
    return chunk.aggregate(loss, mask, params.agg), {}
