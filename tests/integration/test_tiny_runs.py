"""The documented ways to try a graph on the tiny model: flowrl.testing.run_tiny in a test, and
`flowrl run GRAPH --tiny` on the command line."""

import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.testing import run_tiny

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

ROOT = Path(__file__).resolve().parents[2]


def test_run_tiny_trains_a_graph_and_returns_its_metrics(tmp_path):
    run = run_tiny(ROOT / "graphs/ppo.toml", tmp_path)
    assert run.run_dir.parent == tmp_path and (run.run_dir / "graph.toml").is_file()
    assert [row["step"] for row in run.metrics] == [0, 1, 2]
    last = run.metrics[-1]
    assert last["update_policy/grad_norm"] > 0 and last["update_critic/grad_norm"] > 0
    assert last["response_length/max"] <= 6  # max_new_tokens on the tiny model


def test_run_tiny_flag_trains_from_the_command_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "flowrl.cli", "run", "grpo", "--tiny", "--backend", "local"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (run_dir,) = (tmp_path / "runs").glob("grpo-*")
    assert (run_dir / "checkpoints/step_000002").is_dir()


def test_critic_warmup_holds_the_policy_update_for_its_steps(tmp_path):
    run = run_tiny(ROOT / "graphs/ppo.toml", tmp_path, **{"run.critic_warmup": 1})
    first, second = run.metrics[1], run.metrics[2]
    assert first["update_critic/grad_norm"] > 0 and "update_policy/grad_norm" not in first
    assert second["update_policy/grad_norm"] > 0 and second["update_critic/grad_norm"] > 0
