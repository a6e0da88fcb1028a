"""Bad tools at run time, through `flowrl run --tiny` in a process of its own: tools that
block or never return time out, stop being started once MAX_STUCK calls of theirs hang, and
never keep the process alive after its last step; a run whose every request fails stops after
run.max_failed_steps with the first error and the replay command, and each failed request's
error is in samples.jsonl."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flowrl.agent.tools.timeouts import MAX_STUCK

pytestmark = pytest.mark.slow  # the integration tier: trains in a child process

ROOT = Path(__file__).parents[2]
TOOLS = '''
import threading, time

NEVER = threading.Event()


def hang(x: str) -> str:
    """Never return.

    Args:
        x: ignored.
    """
    NEVER.wait()


async def block(x: str) -> str:
    """Block inside async def, for an hour.

    Args:
        x: ignored.
    """
    time.sleep(3600)


def both(text):
    return [("hang", {"x": "1"}), ("block", {"x": "2"})]


class Broken:
    def __init__(self, ground_truth: str = ""):
        raise ConnectionError("sandbox unreachable")

    def submit(self, answer: str) -> str:
        """Submit.

        Args:
            answer: the answer.
        """
        return answer
'''
GRAPH = """
[run]
steps = {steps}
val_size = 0
out_dir = "runs"
[data]
source = "calculator"
batch_size = 2
train_size = 16
max_prompt_len = 1024
[models.policy]
path = "tiny"
trainable = true
[nodes.generate]
uses = "agent"
model = "policy"
n = 2
tools = {tools}
parser = "{parser}"
max_new_tokens = 400
max_turn_tokens = 4
max_assistant_turns = 3
max_parallel_calls = 2
tool_timeout_s = 0.3
[nodes.reward]
uses = "reward.rule"
[nodes.advantage]
uses = "advantage.grpo"
[nodes.update_policy]
uses = "update.policy"
model = "policy"
on_policy = true
"""


def flowrl_run(tmp_path, **values) -> tuple[subprocess.CompletedProcess, float, Path]:
    (tmp_path / "bad_tools.py").write_text(TOOLS)
    (tmp_path / "graph.toml").write_text(textwrap.dedent(GRAPH.format(**values)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "flowrl.cli", "run", "graph.toml", "--backend", "local"]
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    exited = time.time()
    run_dir = next((tmp_path / "runs").iterdir())
    return done, exited, run_dir


def test_hung_and_blocking_tools_time_out_and_the_process_exits_after_its_last_step(tmp_path):
    tools = '["bad_tools.py:hang", "bad_tools.py:block"]'
    done, exited, run_dir = flowrl_run(tmp_path, steps=3, tools=tools, parser="bad_tools.py:both")
    assert done.returncode == 0, done.stderr[-2000:]
    # the last step's metrics were written; the process was gone within seconds after
    assert exited - (run_dir / "metrics.jsonl").stat().st_mtime < 15
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "event" not in r]  # event rows (a zero-gradient warning) aside
    assert [s["step"] for s in steps] == [1, 2, 3]
    # 4 requests x 2 calls a turn time out; each tool stops being started at MAX_STUCK hung
    # calls (the rest are answered at once), so the live threads stay bounded across steps
    assert all(s["generate/tool_timeouts"] >= 2 for s in steps)
    assert all(s["generate/stuck_tool_threads"] == 2 * MAX_STUCK for s in steps)
    assert all(s["generate/requests_trained"] == 1.0 for s in steps)  # the requests went on
    sample = json.loads((run_dir / "samples.jsonl").read_text().splitlines()[0])
    answers = [m["content"] for m in sample["conversation"] if m["role"] == "tool"]
    assert any("TimeoutError" in a for a in answers)


def test_a_run_whose_requests_all_fail_stops_with_the_error_and_the_replay_command(tmp_path):
    done, _, run_dir = flowrl_run(
        tmp_path, steps=5, tools='["bad_tools.py:Broken"]', parser="hermes"
    )
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "2 steps in a row (up to step 2) trained on nothing" in out
    assert "ConnectionError: sandbox unreachable" in out and "--resume" in out
    assert "step 1: 4 of 4 requests failed" in out  # the log shows them as they happen
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # a tool whose service is unreachable: what the request ran on failed (not the model)
    train = [s for s in steps if "generate/termination/infra" in s]
    assert [s["generate/termination/infra"] for s in train] == [1.0, 1.0]
    assert [s["generate/requests_trained"] for s in train] == [0.0, 0.0]
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8  # every failed request, not only the logged ones
    assert all("ConnectionError: sandbox unreachable" in s["error"] for s in samples)


TUTOR = """
class Tutor:
    def __init__(self, config):
        self.config = config

    async def start_interaction(self, instance_id=None):  # no **kwargs: the rows' are refused
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        return False, "try again", 0.0, {}
"""
TUTOR_GRAPH = """
[run]
steps = 4
val_size = 0
out_dir = "runs"
[data]
source = "rows.jsonl"
batch_size = 2
[models.policy]
path = "tiny"
trainable = true
[models.ref]
path = "tiny"
[nodes.generate]
uses = "agent"
model = "policy"
n = 2
interaction = "tutor.py:Tutor"
max_new_tokens = 16
[nodes.reward]
uses = "reward.rule"
[nodes.ref_logprob]
uses = "logprob"
model = "ref"
rename = { logprobs = "ref_logprobs" }
[nodes.advantage]
uses = "advantage.grpo"
[nodes.update_policy]
uses = "update.policy"
model = "policy"
kl_loss_coef = 0.001
on_policy = true
"""


def test_a_step_whose_requests_all_fail_stops_with_the_first_error_not_a_later_one(tmp_path):
    """Every request ends at its start (the interaction refuses the row's kwargs): the step's
    update is passed over, and the run stops with "k of m requests failed; first: ..." and
    the line of the user's method, where the reference log-probs used to fail on responses of
    no tokens ("cannot reshape tensor of 0 elements")."""
    (tmp_path / "tutor.py").write_text(TUTOR)
    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {a} + 3?"}],
            "data_source": "arithmetic",
            "reward_model": {"ground_truth": str(a + 3)},
            "extra_info": {"interaction_kwargs": {"ground_truth": str(a + 3)}},
        }
        for a in range(8)
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "graph.toml").write_text(TUTOR_GRAPH)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "flowrl.cli", "run", "graph.toml", "--backend", "local"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "cannot reshape" not in out and "Traceback" not in out
    first = (
        "4 of 4 requests failed; first: TypeError: Tutor.start_interaction "
        "(tutor.py:6): got an unexpected keyword argument 'ground_truth': "  # cwd-relative
        "give it **kwargs"
    )
    assert f"step 1: {first}" in out and "the step's update was skipped" in out
    assert f"2 steps in a row (up to step 2) trained on nothing: {first}" in out
    run_dir = next((tmp_path / "runs").iterdir())
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "time_s" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert not any(key.startswith("update_policy/") for m in steps for key in m)  # skipped
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and all("give it **kwargs" in s["error"] for s in samples)
