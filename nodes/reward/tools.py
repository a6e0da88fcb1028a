"""Tool rewards added to a rule score: shaping for multi-turn rollouts, in the graph.

reads: rule_scores, rollout_info -> writes: scores
score = rule_score + coef * sum(step rewards the tools returned) + final_coef * sum(tools'
end-of-request rewards) + call_bonus if the request made a call that ran (verl's
gsm8k_toolcall_shaping adds such a bonus). A reward a tool returned that is no finite number
(None, text, NaN, infinity) adds nothing and is counted in this node's `errors` metric.
Wire it after reward.rule renamed:

    [nodes.reward]
    uses = "reward.rule"
    rename = { scores = "rule_scores" }
    [nodes.tool_reward]
    uses = "reward.tools"
    call_bonus = 0.1
"""

from __future__ import annotations

import sys

import attrs

from flowrl.lazy import torch
from flowrl.nodespec import NodeSpec
from flowrl.rewards import BadValue, finite


@attrs.frozen
class Params:
    coef: float = 1.0  # weight of the tools' step rewards (rollout_info.tool_rewards)
    final_coef: float = 0.0  # weight of end-of-request rewards (rollout_reward_scores)
    call_bonus: float = 0.0  # added once when the request made a call that ran


def tool_scores(scores: list[float], infos, coef: float, final_coef: float, call_bonus: float):
    """scores (b,) and each row's rollout_info -> (the shaped scores, a list of b floats; the
    bad values: one message per reward a tool returned that was no finite number, which adds
    nothing)."""
    out, bad = [], []
    for row, (score, info) in enumerate(zip(scores, infos, strict=True)):
        info = info or {}
        calls = info.get("calls", ())
        called = any(call["status"] == "ok" for call in calls)
        bad += [f"{c['error']} on row {row}" for c in calls if c["status"] == "bad_value"]
        final = 0.0
        for tool, value in (info.get("rollout_reward_scores") or {}).items():
            try:
                final += finite(value, f"tool {tool} (end-of-request reward)")
            except BadValue as e:
                bad.append(f"{e} on row {row}")
        out.append(
            float(score)
            + coef * sum(info.get("tool_rewards", ()))
            + final_coef * final
            + (call_bonus if called else 0.0)
        )
    return out, bad


def run(batch, params):
    base = batch["rule_scores"].tolist()
    shaped, bad = tool_scores(
        base, batch["rollout_info"], params.coef, params.final_coef, params.call_bonus
    )
    if bad:  # every one counted; the first said, once per step
        print(
            f"flowrl: {bad[0]}; that reward counts as 0 ({len(bad)} such this step, counted in "
            "the errors metric of this node)",
            file=sys.stderr,
        )
    values = torch.tensor(shaped, dtype=torch.float32)  # (b,)
    bonus = (values - torch.tensor(base, dtype=torch.float32)).mean() if len(base) else 0.0
    return {"scores": values}, {"tool_bonus": float(bonus), "errors": len(bad)}


SPEC = NodeSpec(reads=("rule_scores", "rollout_info"), writes=("scores",), params=Params, fn=run)
