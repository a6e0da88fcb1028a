"""A non-finite loss or gradient norm: the optimizer step is skipped (weights unchanged), the
event is logged with node and step, and the run stops after run.max_nonfinite_steps in a row."""

import json
from pathlib import Path

import pytest
import torch

from flowrl.runtime.controller import Trainer
from flowrl.runtime.guards import NonFiniteStop
from flowrl.testing import parameters

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

NAN_UPDATE = Path(__file__).with_name("nan_update.py")


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
        with pytest.raises(NonFiniteStop, match="2 steps in a row .*update_policy.*--resume"):
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
