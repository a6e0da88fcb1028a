"""Updates that do nothing stop the run with their cause and the step they began. A non-finite
loss or gradient norm: the optimizer step is skipped (weights unchanged), the event is logged
with node and step, and the run stops after run.max_nonfinite_steps in a row. A learning rate far
too large (1e6): the gradient norm falls to 0 over rows with non-zero advantages, and the run
stops rather than end "successfully", writing no checkpoint of the dead weights."""

import json
from pathlib import Path

import pytest
import torch

from flowrl.runtime.controller import Trainer
from flowrl.runtime.guards import UpdatesStop
from flowrl.testing import parameters

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

NAN_UPDATE = Path(__file__).resolve().parents[1] / "support" / "toy" / "nan_update.py"
ROOT = Path(__file__).resolve().parents[2]


def test_nonfinite_updates_are_skipped_then_the_run_stops(tiny_plan, tmp_path):
    plan = tiny_plan(
        "grpo.toml",
        **{
            "nodes.update_policy.uses": f'"{NAN_UPDATE}"',
            "run.max_nonfinite_steps": 2,
            "run.steps": 5,
        },
    )
    trainer = Trainer(plan, tmp_path / "run", "local")
    before = trainer.executor.apply("main", parameters, "policy")[0]
    try:
        said = (
            r"the updates of update_policy did nothing from step 1 to step 2 \(2 steps in a "
            r"row\): update_policy: a non-finite loss or gradient norm .*start again"
        )
        with pytest.raises(UpdatesStop, match=said):
            trainer.fit()
        after = trainer.executor.apply("main", parameters, "policy")[0]
    finally:
        trainer.close()
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    events = [r for r in rows if r.get("event") == "nonfinite"]
    assert events == [
        {"event": "nonfinite", "step": 1, "nodes": ["update_policy"]},
        {"event": "nonfinite", "step": 2, "nodes": ["update_policy"]},
    ]
    assert [r["update_policy/nonfinite_skipped"] for r in rows if "time_s" in r] == [1.0, 1.0]


def test_a_learning_rate_far_too_large_stops_the_run_where_its_updates_died(tmp_path):
    from flowrl.testing import run_tiny

    extra = {"models.policy.lr": 1e6, "run.steps": 6, "run.save_every": 1}
    with pytest.raises(UpdatesStop) as stopped:
        run_tiny(ROOT / "graphs/grpo.toml", tmp_path / "runs", **extra)
    said = str(stopped.value)
    assert "the updates of update_policy did nothing from step 2 to step 4 (3 steps" in said
    assert "a gradient norm of 0 although" in said and "had a non-zero advantage" in said
    assert "[models.policy] lr = 1e+06" in said and "a lower models.policy.lr" in said
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time_s" in r]
    assert [r["update_policy/grad_norm"] > 0 for r in steps] == [True, False, False, False]
    assert all(r["update_policy/signal_rows"] > 0 for r in steps)
    events = [r for r in rows if r.get("event") == "no_gradient"]
    assert [e["step"] for e in events] == [2, 3, 4]
    # step 1's checkpoint was written before the trouble showed; none after it began
    assert [c.name for c in (run_dir / "checkpoints").iterdir()] == ["step_000001"]
