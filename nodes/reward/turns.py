"""An episode's score from its turn rewards: an environment's (`env` on the agent node) or an
interaction's, as rollout_info's `turn_rewards` holds them.

reads: rollout_info -> writes: scores, turn_rewards
score = the sum of the turn rewards (combine = "sum"), their sum discounted by `discount` per
turn from the first (combine = "discounted": r_0 + g r_1 + g^2 r_2 ...), or the last one
(combine = "last"); a request without a turn reward scores `empty_score`. turn_rewards: (b, T)
float32, each row's rewards in turn order, right-padded with 0 (T the most turns of the step).

    [nodes.score]
    uses = "reward.turns"
    combine = "sum"
"""

from __future__ import annotations

import attrs

from flowrl.lazy import torch
from flowrl.nodespec import NodeSpec
from flowrl.params import checked, interval, one_of


@attrs.frozen
class Params:
    combine: str = checked("sum", one_of(("sum", "discounted", "last")))  # of a row's turns
    discount: float = checked(1.0, interval(0, 1))  # per turn, with combine = "discounted"
    empty_score: float = 0.0  # a request with no turn reward (ended before the env answered)


def episode_score(rewards: list[float], combine: str, discount: float, empty: float) -> float:
    if not rewards:
        return empty
    if combine == "last":
        return float(rewards[-1])
    if combine == "discounted":
        return float(sum(r * discount**k for k, r in enumerate(rewards)))
    return float(sum(rewards))


def run(batch, params):
    turns = [list((info or {}).get("turn_rewards", ())) for info in batch["rollout_info"]]
    scores = [episode_score(t, params.combine, params.discount, params.empty_score) for t in turns]
    width = max((len(t) for t in turns), default=0)
    padded = torch.zeros(len(turns), width, dtype=torch.float32)
    for row, rewards in enumerate(turns):
        padded[row, : len(rewards)] = torch.tensor(rewards, dtype=torch.float32)
    metrics = {"turns": sum(map(len, turns)) / max(len(turns), 1)}
    return {"scores": torch.tensor(scores, dtype=torch.float32), "turn_rewards": padded}, metrics


SPEC = NodeSpec(reads=("rollout_info",), writes=("scores", "turn_rewards"), params=Params, fn=run)
