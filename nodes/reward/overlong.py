"""DAPO's soft overlong punishment (Yu et al., arXiv 2503.14476, Eq. 13): a length penalty in
the last `buffer_len` tokens before the response cap, added to each sequence's score.

reads: scores, response_mask -> writes: shaped_scores
With L = max_len (the generate node's max_new_tokens) and B = buffer_len, a response of |y|
tokens gets  score + min(0, -(|y| - (L - B)) / B * penalty_factor):  nothing up to L - B
tokens, then a penalty growing linearly to -penalty_factor at L (verl's `overlong_buffer`:
len, penalty_factor). Graphs feed `shaped_scores` to the advantage and keep `scores` for
validation and for the dynamic-sampling filter (verl filters on the task accuracy).
"""

from __future__ import annotations

import attrs

from flowrl.hooks import Finding
from flowrl.nodespec import NodeSpec
from flowrl.params import MAX_TOKENS, at_least, checked, count


@attrs.frozen
class Params:
    max_len: int = checked(32, count(1, MAX_TOKENS))  # L: the generate node's max_new_tokens
    buffer_len: int = checked(8, count(1, MAX_TOKENS))  # B: the penalty grows over the last B
    penalty_factor: float = checked(1.0, at_least(0))  # the penalty at L


def overlong_penalty(response_mask, max_len: int, buffer_len: int, penalty_factor: float):
    """response_mask (b, t) -> (b,) <= 0: min(0, -(|y| - (L - B)) / B * factor)."""
    lengths = response_mask.sum(-1).float()  # (b,): the sampled tokens
    exceed = lengths - (max_len - buffer_len)
    return (-exceed / buffer_len * penalty_factor).clamp(max=0.0)


def run(batch, params):
    penalty = overlong_penalty(
        batch["response_mask"], params.max_len, params.buffer_len, params.penalty_factor
    )
    shaped = batch["scores"].float() + penalty
    metrics = {"penalty": float(penalty.mean()) if len(penalty) else 0.0}
    metrics["penalised_fraction"] = float((penalty < 0).float().mean()) if len(penalty) else 0.0
    return {"shaped_scores": shaped}, metrics


def check(params: Params, context) -> list[Finding]:
    if params.buffer_len > params.max_len:
        return [
            Finding(
                f"buffer_len = {params.buffer_len} must be at most max_len ({params.max_len})",
                "e.g. buffer_len = max_len // 5",
            )
        ]
    return []


SPEC = NodeSpec(
    reads=("scores", "response_mask"),
    writes=("shaped_scores",),
    params=Params,
    fn=run,
    check=check,
)
