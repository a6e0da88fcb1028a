"""Reward-model update: the Bradley-Terry pairwise loss on preference rows.

reads: raw_prompt, extra_info -> writes: -
loss = -log sigmoid(r(x, y_chosen) - r(x, y_rejected)), the reward model of InstructGPT
(Ouyang et al. 2022, arXiv 2203.02155, eq. 1), as TRL's RewardTrainer computes it, with its
optional centring term `center` * mean((r_chosen + r_rejected)^2) (Eisenstein et al. 2023,
arXiv 2312.09244) that keeps scores near zero. Each conversation is written with the reward
model's chat template (flowrl/models/reward_inputs.py) and scored at its last real token, as a
sequence classifier (flowrl/engines/train/sequence_scores.py). The engine's shared update loop
(`engine.update`) runs epochs x mini-batches (of pairs) x micro-batches, and a chosen /
rejected pair is one of its rows, so a pair always shares a micro-batch. Rows come from a
preference source (flowrl/data/preferences.py).
"""

from __future__ import annotations

import attrs

from flowrl.hooks import MINI_BATCHES
from flowrl.lazy import torch
from flowrl.nodespec import NodeSpec
from flowrl.params import MAX_EPOCHS, MAX_ROWS, at_least, checked, count


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


def pair_rows(tokenizer, batch):
    """Preference rows -> one row per pair, as the engine's update loop batches rows: the chosen
    conversation under `prompts` / `prompt_mask` (b, p), left-padded, and the rejected one
    under `responses` / `response_mask` (b, t), right-padded, each written with the reward
    model's chat template. The loop then sizes micro-batches by both conversations' tokens and
    never splits a pair."""
    from flowrl.models import reward_inputs
    from flowrl.protocol import DataProto

    chats = reward_inputs.preference_chats(batch) if len(batch) else []
    chosen, chosen_mask = reward_inputs.templated(tokenizer, chats[0::2])  # (b, p)
    rejected, rejected_mask = reward_inputs.templated(tokenizer, chats[1::2])  # (b, t)
    width = rejected_mask.sum(-1, keepdim=True)  # (b, 1): left -> right padding
    order = (torch.arange(rejected.shape[1]) + (rejected.shape[1] - width)) % rejected.shape[1]
    return DataProto.from_dict(
        {
            "prompts": chosen,
            "prompt_mask": chosen_mask,
            "responses": rejected.gather(1, order),
            "response_mask": rejected_mask.gather(1, order),
        }
    )


class RewardModelUpdateWorker:
    def __init__(self, engine, params: Params):
        self.engine, self.params = engine, params

    def __call__(self, batch):
        p = self.params
        rows = pair_rows(self.engine.tokenizer, batch)
        metrics = ("bt_loss", "accuracy", "margin")
        return {}, self.engine.update(
            rows,
            self.micro_loss,
            epochs=p.epochs,
            mini_batch_size=p.mini_batch_size,
            metrics=metrics,
        )

    def micro_loss(self, micro, counts):
        """Scores of both conversations of each pair (one forward over 2m sequences), the
        loss summed over the pairs / the mini-batch's pairs (`counts.num_seqs`)."""
        from flowrl.engines.train.sequence_scores import forward_scores

        m, p = len(micro), micro["prompts"].shape[1]
        width = max(p, micro["responses"].shape[1])
        ids = torch.zeros(2 * m, width, dtype=torch.long)
        mask = torch.zeros(2 * m, width, dtype=torch.long)
        ids[:m, width - p :], mask[:m, width - p :] = micro["prompts"], micro["prompt_mask"]
        t = micro["responses"].shape[1]
        ids[m:, :t], mask[m:, :t] = micro["responses"], micro["response_mask"]
        scores = forward_scores(self.engine, ids, mask, grad=True)  # (2m,)
        loss, metrics = bradley_terry_loss(scores[:m], scores[m:], self.params.center)
        metrics = {k: v / counts.num_seqs for k, v in metrics.items()}
        return loss / counts.num_seqs, {
            "bt_loss": float(loss.detach()) / counts.num_seqs,
            **metrics,
        }


SPEC = NodeSpec(
    reads=("raw_prompt", "extra_info"),
    writes=(),
    params=Params,
    worker=RewardModelUpdateWorker,
    mode="train",
    head="value",
    check=MINI_BATCHES.check,
    updates_per_step=MINI_BATCHES.updates,
    own_tokenizer=True,  # templates the conversation with the reward model's tokenizer
)
