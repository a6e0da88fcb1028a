"""run.critic_warmup: the first N steps train only the critic (verl: trainer.critic_warmup)."""

from pathlib import Path

import pytest

from flowrl.cli import load_plan
from flowrl.errors import GraphErrors
from flowrl.runtime.setup import pool_setups

GRAPHS = Path(__file__).resolve().parents[3] / "graphs"


def test_the_policy_update_waits_and_its_schedule_counts_only_its_own_steps():
    plan = load_plan(str(GRAPHS / "ppo.toml"), ["run.critic_warmup=3", "run.steps=10"])
    assert plan.after_warmup == ("update_policy",)
    assert "critic warm-up: update_policy skip steps 1-3" in plan.text()
    total = pool_setups(plan)["main"].optimizer_steps
    per_step = plan.pools["main"].updates_per_step
    assert total["policy"] == per_step["policy"] * 7  # 10 steps, 3 of them the warm-up
    assert total["critic"] == per_step["critic"] * 10


def test_no_warmup_holds_nothing():
    plan = load_plan(str(GRAPHS / "ppo.toml"), ["run.critic_warmup=0"])
    assert plan.after_warmup == () and "critic warm-up" not in plan.text()


@pytest.mark.parametrize(
    "graph, overrides, message",
    [
        ("grpo.toml", ["run.critic_warmup=2"], "no train node updates a value-head model"),
        ("ppo.toml", ["run.critic_warmup=5", "run.steps=5"], "leaves none of the run's 5 steps"),
    ],
)
def test_a_warmup_that_cannot_work_is_an_error(graph, overrides, message):
    with pytest.raises(GraphErrors, match=message) as raised:
        load_plan(str(GRAPHS / graph), overrides)
    assert "[run]" in str(raised.value) and "critic_warmup" in str(raised.value)
