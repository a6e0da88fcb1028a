"""Pairwise accuracy of a reward model on preference rows: does it score chosen over rejected?

reads: raw_prompt, extra_info -> writes: scores
Each row's score is 1 when the reward model scores its chosen response above its rejected one,
0 when below, 1/2 on a tie (a new, zero head scores chance, not 0). As the graph's writer of
`scores`, it makes validation (val/score) the held-out pairwise accuracy. Conversations are
written with the reward model's chat template, as update.reward_model trains on them.
"""

from __future__ import annotations

import attrs

from flowrl.hooks import TinyNode
from flowrl.lazy import torch
from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    pass


def pair_accuracy(chosen, rejected):
    """chosen, rejected (b,) scores -> (b,): 1 where chosen > rejected, 0.5 on a tie, else 0."""
    return (chosen > rejected).float() + 0.5 * (chosen == rejected).float()


class PairwiseAccuracyWorker:
    def __init__(self, engine, params: Params):
        self.engine, self.params = engine, params

    def __call__(self, batch):
        from flowrl.engines.train.sequence_scores import infer_scores
        from flowrl.models import reward_inputs

        chats = reward_inputs.preference_chats(batch)
        ids, mask = reward_inputs.templated(self.engine.tokenizer, chats)  # (2b, s)
        scores = infer_scores(self.engine, ids, mask)
        chosen, rejected = scores[0::2], scores[1::2]  # (b,) each
        accuracy = pair_accuracy(chosen, rejected)
        metrics = {"margin": float((chosen - rejected).mean()) if len(accuracy) else 0.0}
        metrics["chosen_score"] = float(chosen.mean()) if len(accuracy) else 0.0
        return {"scores": accuracy.to(torch.float32)}, metrics


def tiny(params, base_dir: str) -> TinyNode:
    """A tiny run's reward model has random weights, which the run's summary says."""
    return TinyNode(model_role="reward model")


SPEC = NodeSpec(
    reads=("raw_prompt", "extra_info"),
    writes=("scores",),
    params=Params,
    worker=PairwiseAccuracyWorker,
    mode="inference",
    head="value",
    tiny=tiny,
    own_tokenizer=True,  # templates the conversation with the reward model's tokenizer
)
