"""Rule-based reward: a scorer function per row (verl's `compute_score` signature).

reads: response_text, ground_truth, data_source, extra_info (+ rollout_info when
rollout_info = true) -> writes: scores
`scorer = "auto"` picks by each row's data_source (arithmetic, gsm8k, calculator); a path
"my_scorer.py:compute_score" is resolved against the graph file's folder. Rows are scored in
`workers` child processes, each under `timeout_s` (flowrl/rewards/pool.py): a scorer that
raises, hangs or crashes gives that row `fallback_score`, counted in the `errors` and
`timeouts` metrics, and the run goes on. `workers = 0` scores in this process, unguarded
(for stepping through a scorer in a debugger). After an agent node, `rollout_info = true`
hands each request's turns and tool rewards to the scorer inside `extra_info` under verl's
names (num_turns, tool_rewards, turn_scores, rollout_reward_scores), so verl scorers that read
them work unchanged.
"""

from __future__ import annotations

import sys

import attrs

from flowrl.hooks import Finding
from flowrl.lazy import torch
from flowrl.nodespec import NodeSpec
from flowrl.params import checked, count, positive
from flowrl.rewards import BadValue, ScorerError, resolve_scorer, score_value

VERL_KEYS = ("num_turns", "tool_rewards", "turn_scores", "rollout_reward_scores")


@attrs.frozen
class Params:
    scorer: str = "auto"  # "auto", "arithmetic", "gsm8k", or "file.py:function"
    workers: int = checked(2, count(0, 256))  # scoring processes; 0 = in this one, no timeout
    timeout_s: float = checked(10.0, positive())  # seconds one row's scorer may take
    fallback_score: float = 0.0  # the score of a row whose scorer failed or timed out
    rollout_info: bool = False  # merge the agent node's rollout_info into extra_info


def with_rollout_info(infos, rollout_infos) -> list[dict]:
    """Each row's extra_info updated with its request's record under verl's keys."""
    out = []
    for info, rollout in zip(infos, rollout_infos, strict=True):
        merged = dict(info or {})
        merged.update({key: rollout[key] for key in VERL_KEYS if key in (rollout or {})})
        out.append(merged)
    return out


def rule_scores(results, fallback: float) -> tuple[list[float], dict]:
    """Per-row (score, extra) results, None where the scorer failed -> (scores, the mean of
    each extra number scorers returned in dicts)."""
    scores, extras = [], {}
    for result in results:
        score, extra = result if result is not None else (fallback, {})
        scores.append(score)
        for key, value in extra.items():
            extras.setdefault(key, []).append(value)
    return scores, {k: sum(v) / len(v) for k, v in extras.items()}


def _in_process(rows, params, base_dir: str):
    """workers = 0: a scorer's exception propagates (for a debugger); a bad value it returns
    gets the fallback score and is counted, as in the scoring processes."""
    from flowrl.rewards.pool import failure_message

    function = resolve_scorer(params.scorer, base_dir)
    results, errors = [], 0
    for index, row in enumerate(rows):
        try:
            results.append(score_value(function(*row), f"scorer {params.scorer}"))
        except BadValue as e:
            if not errors:
                message = failure_message(params.scorer, rows, index, "bad value", str(e))
                print(message, file=sys.stderr)
            results.append(None)
            errors += 1
    return results, {"errors": errors, "timeouts": 0}


def run(batch, params):
    infos = batch["extra_info"]
    if params.rollout_info:
        infos = with_rollout_info(infos, batch["rollout_info"])
    rows = list(
        zip(
            batch["data_source"],
            batch["response_text"],
            batch["ground_truth"],
            infos,
            strict=True,
        )
    )
    base_dir = getattr(batch, "meta", {}).get("base_dir", ".")
    if params.workers == 0:
        results, counts = _in_process(rows, params, base_dir)
    else:
        from flowrl.rewards.pool import pool_for

        pool = pool_for(params.scorer, base_dir, params.workers, params.timeout_s)
        results, counts = pool.score(rows)
    scores, extra = rule_scores(results, params.fallback_score)
    values = torch.tensor(scores, dtype=torch.float32)  # (b,)
    mean = float(values.mean()) if len(scores) else 0.0
    return {"scores": values}, {"score": mean, **counts, **extra}


def check(params: Params, context) -> list[Finding]:
    """The scorer must resolve (its file exist and define the function) at `flowrl check`."""
    out = []
    try:
        resolve_scorer(params.scorer, context.base_dir)
    except ScorerError as e:
        out.append(Finding(str(e), 'use "auto", a built-in name or "file.py:function"'))
    except Exception as e:  # the scorer's module failed to import
        out.append(Finding(f"scorer {params.scorer}: importing it failed: {e}", "fix that file"))
    return out


SPEC = NodeSpec(
    reads=("response_text", "ground_truth", "data_source", "extra_info"),
    writes=("scores",),
    params=Params,
    fn=run,
    check=check,
    optional_reads={"rollout_info": lambda p: p.rollout_info},
    scorer_param="scorer",
)
