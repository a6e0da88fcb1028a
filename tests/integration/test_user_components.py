"""An advantage estimator and a policy loss from the user's own files (docs/extending.md's
examples, taken from the page) train a graph on Ray as they do in-process: the Ray workers
load the loss from the graph's folder, and the estimator runs on the controller."""

import sys
from pathlib import Path

import pytest

from flowrl.testing import run_tiny

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests/unit"))  # the unit test's page files
from test_extending import write_estimator_and_loss  # noqa: E402


def test_the_pages_estimator_and_loss_train_on_ray(tmp_path):
    graph = write_estimator_and_loss(tmp_path)
    run = run_tiny(graph, tmp_path / "runs", backend="ray")
    steps = [m for m in run.metrics if "time_s" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all("update_policy/truncated_frac" in m for m in steps)
    assert any(m["update_policy/grad_norm"] > 0 for m in steps)
