"""A run whose updates stop doing anything stops with the cause and the step it began: a
gradient norm of 0 over rows with a learning signal, a non-finite loss or gradient, weights
that became non-finite. An update that is empty for a good reason (every advantage 0) does
not count; the last good checkpoint is the one named."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowrl.runtime.executor import StepResult
from flowrl.runtime.guards import DeadUpdates, UpdatesStop

SPEC = SimpleNamespace(
    nodes={"update_policy": SimpleNamespace(model="policy")},
    models={"policy": SimpleNamespace(lr=1e6)},
    run=SimpleNamespace(max_nonfinite_steps=3, steps=100),
)


def update(grad_norm=0.5, signal=1.0, skipped=0.0, broken=0.0) -> StepResult:
    metrics = {
        "update_policy/grad_norm": grad_norm,
        "update_policy/signal_rows": signal,
        "update_policy/nonfinite_skipped": skipped,
        "update_policy/nonfinite_weights": broken,
    }
    return StepResult(None, metrics, [])


def watching(run_dir=Path("/nowhere")) -> DeadUpdates:
    return DeadUpdates(SPEC, run_dir, "flowrl run g.toml")


def test_a_zero_gradient_over_rows_with_signal_counts_from_the_step_it_began():
    watch = watching()
    assert watch.observe(1, update()) == [] and watch.streak == 0 and watch.may_save
    events = []
    for step in (2, 3):
        events.append(watch.observe(step, update(grad_norm=0.0, signal=0.75)))
        watch.check(step)  # below run.max_nonfinite_steps: the run goes on, unsaved
        assert not watch.may_save
    events.append(watch.observe(4, update(grad_norm=0.0, signal=0.75)))
    assert watch.streak == 3 and watch.began == 2 and not watch.fatal
    assert [e[0]["event"] for e in events] == ["no_gradient"] * 3
    assert events[0][0]["said"] == (
        "step 2: update_policy: a gradient norm of 0 although 75% of its rows had a non-zero "
        "advantage: its weights no longer respond to the loss"
    )
    with pytest.raises(UpdatesStop) as stopped:
        watch.check(4)
    said = str(stopped.value)
    assert said.startswith("the updates of update_policy did nothing from step 2 to step 4")
    assert "The usual cause is a learning rate far too large ([models.policy] lr = 1e+06)" in said
    assert "(step 1) was kept: start again with a lower models.policy.lr: flowrl run g.toml" in said


def test_an_update_with_no_signal_is_rightly_empty_and_does_not_count():
    watch = watching()
    for step in (1, 2, 3, 4):  # GRPO, every group's scores equal: advantages all 0
        assert watch.observe(step, update(grad_norm=0.0, signal=0.0)) == []
        watch.check(step)
    assert watch.streak == 0 and watch.may_save


def test_a_streak_at_the_last_step_stops_the_run_rather_than_end_it_done():
    watch = watching()
    watch.observe(99, update())
    watch.check(99)
    watch.observe(100, update(grad_norm=0.0))  # run.steps = 100: one dead step is enough
    with pytest.raises(UpdatesStop, match="did nothing at step 100 \\(1 step in a row\\)"):
        watch.check(100)


def test_non_finite_and_zero_gradient_steps_make_one_streak_and_a_good_step_ends_it():
    watch = watching()
    (event,) = watch.observe(1, update(grad_norm=float("nan"), skipped=1.0))
    assert event["event"] == "nonfinite" and event["nodes"] == ["update_policy"]
    watch.observe(2, update(grad_norm=0.0))
    assert watch.streak == 2 and watch.began == 1
    watch.observe(3, update())
    assert watch.streak == 0
    watch.observe(4, update(grad_norm=0.0))
    assert watch.streak == 1 and watch.began == 4


def test_weights_that_became_non_finite_stop_at_once():
    watch = watching()
    (event,) = watch.observe(3, update(broken=1.0))
    assert watch.fatal and event["event"] == "nonfinite"
    assert "its weights became non-finite in this step's update" in event["said"]
    with pytest.raises(UpdatesStop, match="at step 3 \\(1 step in a row\\)"):
        watch.check(3)


def checkpoints(run_dir: Path, steps) -> None:
    from flowrl.runtime import checkpoint

    for step in steps:
        with checkpoint.writing(run_dir, step, keep=10) as out:
            (out / "controller.json").write_text("{}")


def test_the_stop_names_the_last_checkpoint_before_the_update_that_began_it(tmp_path):
    checkpoints(tmp_path, [2, 4, 5])
    watch = watching(tmp_path)
    for step in (6, 7, 8):
        watch.observe(step, update(grad_norm=0.0))
    with pytest.raises(UpdatesStop) as stopped:
        watch.check(8)
    said = str(stopped.value)
    # step 6's zero gradient came from the weights step 5's update made: step 4's are good
    good = tmp_path / "checkpoints" / "step_000004"
    assert f"the last before the update that began it is {good}" in said
    assert f"flowrl run g.toml --resume {good} --allow-graph-change" in said


def test_the_engine_reports_weights_that_are_not_finite_after_its_step():
    from flowrl.testing import tiny_engine

    engine = tiny_engine()
    first = next(engine.module.parameters())
    first.grad = torch.zeros_like(first)
    assert engine.step()["nonfinite_weights"] == 0.0
    with torch.no_grad():  # what a learning rate far too large does: every weight overflows
        for weight in engine.module.parameters():
            weight.mul_(float("inf"))
    first.grad = torch.zeros_like(first)
    metrics = engine.step()
    assert metrics["nonfinite_weights"] == 1.0 and metrics["nonfinite_skipped"] == 0.0


@pytest.mark.parametrize(("advantage", "signal"), [(0.0, 0.0), (1.0, 0.5)])
def test_update_policy_reports_the_share_of_rows_with_a_learning_signal(advantage, signal):
    from flowrl.nodes.update import policy
    from flowrl.testing import tiny_engine, update_rows

    rows = update_rows(b=4)
    rows["advantages"] = torch.zeros_like(rows["advantages"])
    rows["advantages"][:2, 0] = advantage  # two of four rows, when non-zero
    _, metrics = policy.PolicyUpdateWorker(tiny_engine(), policy.Params())(rows)
    assert metrics["signal_rows"] == signal
