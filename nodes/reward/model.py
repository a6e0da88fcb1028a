"""A learned reward model: a sequence classifier's score of each conversation.

reads: prompts, prompt_mask, responses, response_mask, response_attention, raw_prompt,
response_text -> writes: scores

The score is the head at the last real token of prompt + response, read exactly as
transformers' `*ForSequenceClassification` reads it (flowrl/engines/train/sequence_scores.py); in a
multi-turn row that token may be tool output. The reward model has its own tokenizer and chat
template (`tokenizer`, default: the one in its directory). When its vocabulary is the policy's,
the policy's ids pass through; otherwise, or with `retemplate`, the conversation (prompt
messages and decoded response) is written again with the reward model's chat template, as
verl does (flowrl/models/reward_inputs.py). docs/algorithms.md, "Reward models".
"""

from __future__ import annotations

import attrs

from flowrl.hooks import CheckContext, Finding, TinyNode
from flowrl.nodespec import NodeSpec

POLICY = "policy"  # `tokenizer = "policy"`: read the policy's ids as they are


@attrs.frozen
class Params:
    scale: float = 1.0  # multiply the model's score
    tokenizer: str = ""  # "": the reward model's own; "policy": the policy's ids; or a path
    retemplate: bool = False  # write the conversation with the RM's template even if vocab match
    rollout_info: bool = False  # multi-turn rows: read their messages from the agent node
    whiten: bool = False  # scores to zero mean, unit std over the rank's rows (then x scale)


def check(p: Params, context: CheckContext) -> list[Finding]:
    """Refuse a tokenizer mismatch the node cannot resolve, from the tokenizer files alone."""
    from flowrl.models.tokenizer_files import has_chat_template, vocabulary

    own = context.model_path if p.tokenizer in ("", POLICY) else p.tokenizer
    base, policy = context.base_dir, context.policy_path
    if not policy or own == policy:
        return []
    mine, theirs = vocabulary(own, base), vocabulary(policy, base)
    differ = mine is not None and theirs is not None and mine != theirs
    where = f"reward model {own!r} and policy {policy!r}"
    if differ and p.tokenizer == POLICY:
        return [
            Finding(
                f'{where} have different vocabularies, and tokenizer = "policy" would read the '
                "policy's token ids as the reward model's",
                'remove tokenizer = "policy": the conversation is then written again with the '
                "reward model's own tokenizer and chat template",
            )
        ]
    if (differ or p.retemplate) and has_chat_template(own, base) is False:
        return [
            Finding(
                f"{where}: the conversation must be written with the reward model's tokenizer,"
                " which has no chat template",
                f"give {own} a chat template (tokenizer_config.json or chat_template.jinja), "
                "or set tokenizer to a directory whose tokenizer has one",
            )
        ]
    return []


def whitened(scores, eps: float = 1e-6):
    """scores (b,) -> (b,) with zero mean and unit standard deviation over the rows.

    A Bradley-Terry reward model is defined up to a constant and its scale depends on its
    training (a short run leaves scores within a few hundredths), so `kl_coef` would weigh
    differently against each one. OpenRLHF normalises with its training data's mean and std
    (`normalize_reward`); this uses the step's rows instead, which needs nothing from training
    but amplifies noise when the rows are all alike."""
    if len(scores) < 2:
        return scores - scores.mean() if len(scores) else scores
    return (scores - scores.mean()) / (scores.std() + eps)


class RewardModelWorker:
    def __init__(self, engine, params: Params):
        self.engine, self.params = engine, params
        self.tokenizer = engine.tokenizer
        if params.tokenizer not in ("", POLICY):
            from flowrl.models.loading import load_tokenizer

            self.tokenizer = load_tokenizer(params.tokenizer)

    def inputs(self, batch):
        """ids, mask (b, s) as the reward model reads them."""
        from flowrl.engines.train import sequence_scores
        from flowrl.models import reward_inputs

        same = self._policy_vocabulary(batch)
        if same is False and self.params.tokenizer == POLICY:
            raise ValueError(
                f"the reward model's vocabulary differs from the policy's "
                f"({batch.meta['policy_tokenizer']}), so it cannot read the policy's ids: remove"
                ' tokenizer = "policy" to write the conversation with its own tokenizer'
            )
        if self.params.tokenizer == POLICY or (same and not self.params.retemplate):
            return sequence_scores.joined(batch)
        return reward_inputs.templated(self.tokenizer, reward_inputs.conversations(batch))

    def _policy_vocabulary(self, batch) -> bool | None:
        """Whether the batch's ids are in the reward model's vocabulary: the controller names
        the policy's tokenizer in the batch's meta (None when it does not)."""
        from flowrl.models import reward_inputs

        path = batch.meta.get("policy_tokenizer")
        if not path:
            return None
        policy = reward_inputs.policy_tokenizer(path)
        return reward_inputs.same_vocabulary(policy, self.tokenizer)

    def __call__(self, batch):
        from flowrl.engines.train.sequence_scores import infer_scores

        ids, mask = self.inputs(batch)
        raw = infer_scores(self.engine, ids, mask)  # (b,)
        scores = whitened(raw) if self.params.whiten else raw
        metrics = {"score": float(raw.mean()) if len(raw) else 0.0}
        if len(raw) > 1:
            metrics["score_std"] = float(raw.std())
        return {"scores": scores * self.params.scale}, metrics


def tiny(params, base_dir: str) -> TinyNode:
    """A tiny run's reward model has random weights, which the run's summary says."""
    return TinyNode(model_role="reward model")


SPEC = NodeSpec(
    reads=("prompts", "prompt_mask", "responses", "response_mask", "response_attention"),
    writes=("scores",),
    params=Params,
    worker=RewardModelWorker,
    mode="inference",
    head="value",
    tiny=tiny,
    check=check,
    own_tokenizer=True,  # its own template, or the policy's ids where `check` finds they fit
    optional_reads={
        "raw_prompt": lambda p: p.tokenizer != POLICY,
        "response_text": lambda p: p.tokenizer != POLICY,
        "rollout_info": lambda p: p.tokenizer != POLICY and p.rollout_info,
    },
)
