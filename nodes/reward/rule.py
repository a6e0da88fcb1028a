"""Rule-based reward: a scorer function per row (verl's `compute_score` signature).

reads: response_text, ground_truth, data_source, extra_info (+ rollout_info when
rollout_info = true) -> writes: scores
`scorer = "auto"` picks by each row's data_source (arithmetic, gsm8k, calculator); a path
"my_scorer.py:compute_score" is resolved against the working directory. After an agent node,
`rollout_info = true` hands each request's turns and tool rewards to the scorer inside
`extra_info` under verl's names (num_turns, tool_rewards, turn_scores, rollout_reward_scores),
so verl scorers that read them work unchanged.
"""

from __future__ import annotations

import attrs

from flowrl.lazy import torch
from flowrl.nodespec import NodeSpec
from flowrl.rewards import resolve_scorer, score_value

VERL_KEYS = ("num_turns", "tool_rewards", "turn_scores", "rollout_reward_scores")


@attrs.frozen
class Params:
    scorer: str = "auto"  # "auto", "arithmetic", "gsm8k", or "file.py:function"
    rollout_info: bool = False  # merge the agent node's rollout_info into extra_info


_SCORERS: dict[str, object] = {}  # resolved once per spec, not every step


def with_rollout_info(infos, rollout_infos) -> list[dict]:
    """Each row's extra_info updated with its request's record under verl's keys."""
    out = []
    for info, rollout in zip(infos, rollout_infos, strict=True):
        merged = dict(info or {})
        merged.update({key: rollout[key] for key in VERL_KEYS if key in (rollout or {})})
        out.append(merged)
    return out


def rule_scores(texts, truths, sources, infos, scorer) -> tuple[list[float], dict]:
    """One score per row, and the mean of any extra numbers scorers return in dicts."""
    scores, extras = [], {}
    for text, truth, source, info in zip(texts, truths, sources, infos, strict=True):
        score, extra = score_value(scorer(source, text, truth, info))
        scores.append(score)
        for key, value in extra.items():
            extras.setdefault(key, []).append(value)
    return scores, {k: sum(v) / len(v) for k, v in extras.items()}


def run(batch, params):
    if params.scorer not in _SCORERS:
        _SCORERS[params.scorer] = resolve_scorer(params.scorer)
    infos = batch["extra_info"]
    if params.rollout_info:
        infos = with_rollout_info(infos, batch["rollout_info"])
    scores, extra = rule_scores(
        batch["response_text"],
        batch["ground_truth"],
        batch["data_source"],
        infos,
        _SCORERS[params.scorer],
    )
    values = torch.tensor(scores, dtype=torch.float32)  # (b,)
    mean = float(values.mean()) if len(scores) else 0.0
    return {"scores": values}, {"score": mean, **extra}


SPEC = NodeSpec(
    reads=("response_text", "ground_truth", "data_source", "extra_info"),
    writes=("scores",),
    params=Params,
    fn=run,
    optional_reads={"rollout_info": lambda p: p.rollout_info},
)
