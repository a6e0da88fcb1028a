"""A rollout backend from a user's own file, with only the members docs/extending.md lists,
runs a graph end to end (check, build by the pool worker with its options and seed, generate,
validation, update) with no edit of flowrl."""

import sys
from pathlib import Path

import pytest

from flowrl import refs
from flowrl.testing import run_tiny

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests/unit/engines"))  # the unit test's backend file
from test_rollout_backends import user_backend  # noqa: E402


def test_a_tiny_grpo_run_samples_from_a_backend_in_the_users_file(tmp_path):
    path = user_backend(tmp_path)
    graph = tmp_path / "grpo_echo.toml"
    text = (ROOT / "graphs/grpo.toml").read_text()
    text = text.replace("[models.policy]\n", '[models.policy]\nrollout = "echo_rollout.py:Echo"\n')
    graph.write_text(text + "\n[models.policy.rollout_options]\nvocab = 30\n")
    run = run_tiny(graph, tmp_path / "runs")
    echo = refs.load(f"{path}:Echo")
    (built,) = echo.built  # one rank, one model on it
    assert built.options.vocab == 30 and built.where == "pool main, rank 0, model policy"
    sampled = [r for r in built.calls if r.sampling.do_sample]
    assert sampled and all(r.max_new_tokens == 6 for r in sampled)  # the tiny run's limit
    steps = [m for m in run.metrics if m["step"] > 0]
    assert len(steps) == 2 and all(m["response_length/mean"] == 6 for m in steps)
    # every response has 6 tokens, so the tiny run's length scorer gives every row the same
    # score: the update runs, with zero advantages
    assert all(m["update_policy/grad_norm"] == 0 for m in steps)
    assert run.metrics[0]["val/response_length"] == 6  # validation sampled from it too
