"""ReMax (Li et al., arXiv 2310.10505): the greedy response's score is the baseline.

reads: token_rewards, baseline_scores, response_mask -> writes: advantages, returns
As verl: A_t = (sum of the row's token rewards from t on) - the greedy score, so a KL penalty
in the reward (reward.kl_penalty) counts only from each token on; with the score alone on the
last token (reward.token_rewards) every token gets score - greedy score. `baseline_scores`
comes from a second, greedy generate node scored by a second reward node (graphs/remax.toml).
"""

from __future__ import annotations

import attrs

from flowrl.lazy import torch
from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    pass


def remax_advantages(scores, baseline_scores, response_mask):
    """(b,), (b,), (b, t) -> (b, t): score - greedy score on every response token (the
    outcome-only case of `remax_return_advantages`)."""
    return (scores.float() - baseline_scores.float())[:, None] * response_mask


def remax_return_advantages(token_rewards, baseline_scores, response_mask):
    """(b, t), (b,), (b, t) -> (b, t): reward-to-go minus the greedy score, on trained tokens.

    G_t = sum_{s >= t, mask_s = 1} r_s (undiscounted; rewards under mask 0 are not counted).
    """
    mask = response_mask.to(token_rewards.dtype)
    returns = torch.flip(torch.cumsum(torch.flip(token_rewards * mask, [-1]), -1), [-1])
    return (returns - baseline_scores.float()[:, None]) * mask


def run(batch, params):
    adv = remax_return_advantages(
        batch["token_rewards"], batch["baseline_scores"], batch["response_mask"]
    )
    return {"advantages": adv, "returns": adv}


SPEC = NodeSpec(
    reads=("token_rewards", "baseline_scores", "response_mask"),
    writes=("advantages", "returns"),
    params=Params,
    fn=run,
)
