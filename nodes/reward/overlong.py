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

from flowrl.nodespec import Finding, NodeSpec


@attrs.frozen
class Params:
    max_len: int = 32  # L: the response cap, the generate node's max_new_tokens
    buffer_len: int = 8  # B: the penalty grows over the last B tokens before L
    penalty_factor: float = 1.0  # the penalty at L


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
    if not 0 < params.buffer_len <= params.max_len:
        return [
            Finding(
                f"buffer_len = {params.buffer_len} must be in 1..max_len ({params.max_len})",
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
