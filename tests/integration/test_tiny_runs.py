"""The documented ways to try a graph on the tiny model: flowrl.testing.run_tiny in a test, and
`flowrl run GRAPH --tiny` on the command line; an agent's interactions (a verl YAML's, a verl
class by reference) answer at least two turns of a tiny run, as its samples.jsonl shows."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.cli import main
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


def interaction_turns(run_dir: Path, reply: str) -> list[int]:
    """Per training sample of samples.jsonl: how many of its messages are the interaction's
    `reply` (the user's turns after the prompt)."""
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples
    return [
        sum(m["role"] == "user" and m["content"].startswith(reply) for m in s["conversation"])
        for s in samples
    ]


def test_a_tiny_run_of_the_verl_example_runs_its_interaction_twice(tmp_path, monkeypatch, capsys):
    """examples/verl_gsm8k under `flowrl run --tiny`: its verl BaseInteraction, from its verl
    interaction YAML, answers two turns of every request after the scripted tool round."""
    example = tmp_path / "examples" / "verl_gsm8k"  # its chat_template: ../../graphs/...
    shutil.copytree(
        ROOT / "examples/verl_gsm8k", example, ignore=shutil.ignore_patterns("*.parquet")
    )
    shutil.copytree(ROOT / "graphs/chat_templates", tmp_path / "graphs/chat_templates")
    monkeypatch.syspath_prepend(str(example))
    import build_data

    monkeypatch.setattr("sys.argv", ["build_data.py", "--out", str(example)])
    build_data.main()
    out_dir = f'run.out_dir="{tmp_path / "runs"}"'
    assert main(["run", str(example / "graph.toml"), "--tiny", "--backend", "local", out_dir]) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    wrong = "Your response is incorrect!"  # the random policy never answers right
    assert all(turns >= 2 for turns in interaction_turns(run_dir, wrong))
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    replies = [s["generate/interactions/gsm8k"] for s in steps if s["step"] > 0]
    assert len(replies) == 2 and min(replies) >= 2.0
    summary = capsys.readouterr().out
    assert "  real     interaction gsm8k of [nodes.generate]: 2.00 replies per request" in summary
    assert "(interaction.yaml: gsm8k_interaction.Gsm8kInteraction)" in summary


JUDGE = '''
class JudgeInteraction:
    """verl's BaseInteraction shape, never satisfied."""

    def __init__(self, config):
        self.name, self.live = config["name"], set()

    async def start_interaction(self, instance_id=None, **kwargs):
        self.live.add(instance_id)
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        assert instance_id in self.live and messages[-1]["role"] == "assistant"
        return False, "Try again.", 0.0, {}

    async def finalize_interaction(self, instance_id, **kwargs):
        self.live.remove(instance_id)
'''


def test_a_tiny_run_with_a_verl_interaction_class_runs_it_twice(tmp_path):
    (tmp_path / "judge.py").write_text(JUDGE)
    text = (ROOT / "graphs/grpo_tools.toml").read_text()
    interaction = 'interaction = "judge.py:JudgeInteraction"'
    (tmp_path / "g.toml").write_text(text.replace('tools = ["calculator"]', interaction))
    run = run_tiny(tmp_path / "g.toml", tmp_path / "runs")
    assert all(turns >= 2 for turns in interaction_turns(run.run_dir, "Try again."))
    train = [m for m in run.metrics if m["step"] > 0]
    assert all(m["generate/interactions/judge"] == 2.0 for m in train)
    assert all(m["generate/termination/max_turns"] == 1.0 for m in train)
    assert "  real     interaction judge of [nodes.generate]: 2.00 replies" in run.summary
