"""The trainer's step guards (flowrl/runtime/guards.py), each through the one protocol the loop
asks: failed requests stop a run after run.max_failed_steps steps in a row that trained on
nothing, a gradient norm of 0 for three steps is a warning said once per node, and a model
whose nodes write the text again with their own tokenizer (`NodeSpec.own_tokenizer`) need not
share the policy's. Updates that do nothing: test_dead_updates.py."""

from pathlib import Path
from types import SimpleNamespace

import attrs
import numpy as np
import pytest
import torch

from flowrl.nodespec import NodeSpec
from flowrl.protocol import DataProto
from flowrl.runtime import guards, step_log
from flowrl.runtime.executor import StepResult

SPEC = SimpleNamespace(file="g.toml", run=SimpleNamespace(max_failed_steps=2, steps=10))


def requests(errors: list[str | None], trained_tokens: int = 2) -> StepResult:
    """A multi-turn step whose requests end with `errors` (None: answered)."""
    rows = DataProto.from_dict(
        {"response_mask": torch.full((len(errors), 2), int(trained_tokens > 0), dtype=torch.long)}
    )
    infos = np.empty(len(errors), dtype=object)
    for i, error in enumerate(errors):
        infos[i] = {"termination": "error" if error else "stop", "error": error}
    rows["rollout_info"] = infos
    if said := step_log.failed_step(rows):  # what the walk marks when it passes the update over
        rows.meta[step_log.FAILED_STEP] = said
    return StepResult(rows, {}, [])


def test_failed_requests_are_shown_each_step_and_stop_the_run_after_the_limit():
    guard = guards.FailedRequests(SPEC, Path("runs/g"))
    (event,) = guard.observe(1, requests(["E: a (x.py:3)", None]))  # half: trains on the rest
    assert {k: event[k] for k in ("event", "step", "count")} == {
        "event": "failed_requests",
        "step": 1,
        "count": 1,
    }
    assert event["said"].startswith("step 1: 1 of 2 requests failed\n  request 0 (row uid 0")
    guard.check(1)
    guard.observe(2, requests(["E: a (x.py:3)"] * 2))
    guard.check(2)  # one step that trained on nothing: tolerated
    guard.observe(3, requests([None, None]))
    guard.check(3)  # a good step ends the streak
    for step in (4, 5):
        (event,) = guard.observe(step, requests(["E: b (y.py:7)"] * 2))
        assert event["said"].startswith(f"step {step}: 2 of 2 requests failed; first: E: b")
        assert "the step's update was skipped" in event["said"]
    assert guard.may_save  # a step passed over changed no weights
    with pytest.raises(guards.FailedStepsStop) as stopped:
        guard.check(5)
    said = str(stopped.value)
    assert said.startswith(
        "2 steps in a row (up to step 5) trained on nothing: 2 of 2 requests failed; first: "
        "E: b (y.py:7). The first, with their rows:\n  request 0 (row uid 0, error): E: b"
    )
    assert said.endswith(
        "Fix the tools or rows (flowrl check g.toml), then replay with flowrl run g.toml "
        f"--resume {Path('runs/g')} (run.max_failed_steps sets how many are tolerated)"
    )


def test_a_step_with_no_failed_request_but_no_token_trained_counts_too():
    guard = guards.FailedRequests(SPEC, Path("runs/g"))
    for step in (1, 2):
        assert guard.observe(step, requests([None, None], trained_tokens=0)) == []
    with pytest.raises(guards.FailedStepsStop, match="every request failed or had no sampled"):
        guard.check(2)


def grad_norms(**norms) -> StepResult:
    return StepResult(None, {f"{node}/grad_norm": v for node, v in norms.items()}, [])


def test_a_gradient_norm_of_0_for_three_steps_is_a_warning_said_once_per_node():
    guard = guards.ZeroGradients()
    said = []
    for step in range(1, 8):
        critic = 0.0 if step >= 3 else 1.0  # the critic's goes to 0 two steps later
        events = guard.observe(step, grad_norms(update_policy=0.0, update_critic=critic))
        guard.check(step)  # a warning only: it never stops the run
        assert guard.may_save
        said += [(e["step"], e["said"]) for e in events]
    assert [step for step, _ in said] == [3, 5]
    assert said[0][1] == (
        "warning: step 3: the gradient norm of update_policy has been 0 for 3 steps in a row: "
        "nothing is learned. Either the learning rate is far too large (check [models] lr) or "
        "every reward within a group is the same (the advantages are 0: check the scorer, "
        "score/mean and its spread)"
    )
    assert "of update_critic has been 0" in said[1][1]


def test_a_zero_gradient_streak_broken_by_a_step_starts_again():
    guard = guards.ZeroGradients()
    norms = [0.0, 0.0, 0.5, 0.0, 0.0]  # never three in a row
    assert all(guard.observe(s, grad_norms(u=v)) == [] for s, v in enumerate(norms, 1))


def test_every_guard_of_a_run_answers_the_loops_three_questions(tmp_path):
    for guard in guards.step_guards(SPEC, tmp_path, "flowrl run g.toml"):
        assert callable(guard.observe) and callable(guard.check)
        assert guard.may_save is True  # before any step, nothing holds a checkpoint back


# -- the hook instead of a param name: NodeSpec.own_tokenizer -----------------------------


@attrs.frozen
class NoParams:
    pass


class Worker:
    def __init__(self, engine, params):
        pass


def node(own_tokenizer: bool) -> SimpleNamespace:
    spec = NodeSpec(
        ("prompts",), ("scores",), NoParams, worker=Worker, mode="inference", head="value",
        own_tokenizer=own_tokenizer,
    )  # fmt: skip
    return SimpleNamespace(spec=spec, params=NoParams(), model="judge", mode="inference")


def models_spec(monkeypatch, own_tokenizer: bool) -> SimpleNamespace:
    """The tiny policy, and a judge model whose tokenizer has one token more."""
    from flowrl.models import loading
    from flowrl.models.tiny import tiny_tokenizer

    other = tiny_tokenizer()
    other.add_tokens(["<judge>"])
    monkeypatch.setattr(loading, "load_tokenizer", {"judge": other}.__getitem__)
    return SimpleNamespace(
        file="g.toml",
        data=SimpleNamespace(max_prompt_len=16),
        models={"policy": SimpleNamespace(path="tiny"), "judge": SimpleNamespace(path="judge")},
        nodes={"judge": node(own_tokenizer)},
    )


def test_a_model_read_with_the_policys_ids_must_share_its_tokenizer(monkeypatch):
    from flowrl.models.tiny import tiny_tokenizer

    spec = models_spec(monkeypatch, own_tokenizer=False)
    with pytest.raises(guards.ModelMismatch, match=r"\[models.judge\] path = .* another"):
        guards.check_models(spec, "policy", tiny_tokenizer())


def test_a_model_whose_nodes_use_their_own_tokenizer_need_not(monkeypatch):
    from flowrl.models.tiny import tiny_tokenizer

    spec = models_spec(monkeypatch, own_tokenizer=True)
    guards.check_models(spec, "policy", tiny_tokenizer())


def test_own_tokenizer_is_refused_on_a_node_without_a_model():
    with pytest.raises(ValueError, match="own_tokenizer is for model nodes"):
        NodeSpec((), ("scores",), NoParams, fn=lambda batch, params: {}, own_tokenizer=True)


def test_the_built_in_nodes_that_template_with_the_reward_models_tokenizer_say_so():
    from flowrl.front.registry import resolve

    users = ["reward.model", "reward.pairwise", "update.reward_model"]
    assert all(resolve(name).spec.own_tokenizer for name in users)
    assert not resolve("logprob").spec.own_tokenizer  # reads the policy's ids
