"""Reward-model update: the Bradley-Terry pairwise loss on preference rows.

reads: raw_prompt, extra_info -> writes: -
loss = -log sigmoid(r(x, y_chosen) - r(x, y_rejected)), the reward model of InstructGPT
(Ouyang et al. 2022, arXiv 2203.02155, eq. 1), as TRL's RewardTrainer computes it, with its
optional centring term `center` * mean((r_chosen + r_rejected)^2) (Eisenstein et al. 2023,
arXiv 2312.09244) that keeps scores near zero. Each conversation is written with the reward
model's chat template (flowrl/models/reward_inputs.py) and scored at its last real token, as a
sequence classifier (flowrl/engines/sequence_scores.py); a chosen / rejected pair always
shares a micro-batch. Rows come from a preference source (flowrl/data/preferences.py).
"""

from __future__ import annotations

import attrs

from flowrl.front.validators import MAX_EPOCHS, MAX_ROWS, at_least, checked, count
from flowrl.lazy import torch
from flowrl.nodespec import MINI_BATCHES, NodeSpec


@attrs.frozen
class Params:
    epochs: int = checked(1, count(1, MAX_EPOCHS))  # passes over the step's pairs
    mini_batch_size: int = checked(0, count(0, MAX_ROWS))  # pairs per optimizer step; 0 = all
    center: float = checked(0.0, at_least(0))  # TRL's center_rewards_coefficient


def bradley_terry_loss(chosen, rejected, center: float = 0.0):
    """chosen, rejected (b,) scores -> (loss summed over the pairs, metrics of these pairs).

    Summed, not averaged, so micro-batches add up to the mini-batch's sum; the caller divides
    by the mini-batch's pair count."""
    margin = chosen - rejected  # (b,)
    loss = -torch.nn.functional.logsigmoid(margin).sum()
    if center:
        loss = loss + center * ((chosen + rejected) ** 2).sum()
    metrics = {
        "accuracy": float((margin > 0).float().sum() + 0.5 * (margin == 0).float().sum()),
        "margin": float(margin.detach().sum()),
    }
    return loss, metrics


class RewardModelUpdateWorker:
    def __init__(self, engine, params: Params):
        self.engine, self.params = engine, params

    def __call__(self, batch):
        from flowrl.math import ops

        p, engine = self.params, self.engine
        steps = [
            self.mini_batch(mini)
            for _ in range(p.epochs)
            for mini in engine.mini_batches(batch, p.mini_batch_size)
        ]
        return {}, ops.mean_metrics(steps)

    def mini_batch(self, mini) -> dict:
        from flowrl.engines.sequence_scores import chunks, forward_scores
        from flowrl.models import reward_inputs

        engine = self.engine
        pairs = max(engine.all_reduce_sum(len(mini)), 1)
        totals = {"bt_loss": 0.0, "accuracy": 0.0, "margin": 0.0}
        chats = reward_inputs.preference_chats(mini) if len(mini) else []
        ids, mask = reward_inputs.templated(engine.tokenizer, chats)  # (2m, s) interleaved
        parts = [part for part in chunks(mask, engine.micro_tokens, group=2) if len(part)]
        # under fsdp every rank makes as many passes (TrainEngine._in_lockstep)
        for part in engine._in_lockstep(parts, grad=True):
            scores = forward_scores(engine, ids[part], mask[part], grad=True)
            loss, metrics = bradley_terry_loss(scores[0::2], scores[1::2], self.params.center)
            engine.backward(loss / pairs)
            totals["bt_loss"] += float(loss.detach())
            totals["accuracy"] += metrics["accuracy"]
            totals["margin"] += metrics["margin"]
        totals = {k: engine.all_reduce_sum(v) / pairs for k, v in totals.items()}
        return {**totals, **engine.step()}


SPEC = NodeSpec(
    reads=("raw_prompt", "extra_info"),
    writes=(),
    params=Params,
    worker=RewardModelUpdateWorker,
    mode="train",
    head="value",
    check=MINI_BATCHES.check,
    updates_per_step=MINI_BATCHES.updates,
)
