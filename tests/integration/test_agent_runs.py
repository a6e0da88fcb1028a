"""Multi-turn runs on the tiny model through the executors: the train engine's log-probs of
multi-turn rows equal the rollout's at the trained positions (local and Ray, the Ray run over
two ranks), and a verl-format parquet with tools_kwargs runs through `flowrl run` with the
answer-check tool, whose create_kwargs and rewards reach the scorer."""

import json
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import flowrl
from flowrl.cli import load_plan, main
from flowrl.runtime.controller import Trainer

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

SCORER = Path(flowrl.__file__).parent / "rewards" / "varied.py"  # scores by length
TOOLS = '''
def echo(text: str) -> str:
    """Echo the text back.

    Args:
        text: anything.
    """
    return "echo:" + text


def always(text):
    return [("echo", {"text": text[:3]})]


def answer_seven(text):
    return [("calc_gsm8k_reward", {"answer": "7"})]


def tool_reward(data_source, solution_str, ground_truth, extra_info):
    return extra_info["rollout_reward_scores"]["AnswerCheck"]
'''

GRAPH = """
[run]
steps = {steps}
val_size = 0
out_dir = "{out}"
[data]
source = "{source}"
batch_size = {batch}
max_prompt_len = 1024
{train_size}
[models.policy]
path = "tiny"
trainable = true
lr = 0.01
[pools.main]
workers = {workers}
cpus_per_worker = 1
[nodes.generate]
uses = "agent"
model = "policy"
n = 2
tools = ["{tool}"]
parser = "{parser}"
max_new_tokens = 80
max_turn_tokens = 5
max_assistant_turns = 3
{extra_nodes}
[nodes.reward]
uses = "reward.rule"
scorer = "{scorer}"
rollout_info = true
[nodes.advantage]
uses = "advantage.grpo"
[nodes.update_policy]
uses = "update.policy"
model = "policy"
on_policy = {on_policy}
"""
OLD_LOGPROB = """
[nodes.old_logprob]
uses = "logprob"
model = "policy"
rename = { logprobs = "old_logprobs" }
"""


def write_graph(tmp_path, **values) -> Path:
    (tmp_path / "my_tools.py").write_text(TOOLS)
    defaults = {
        "steps": 1,
        "out": tmp_path / "runs",
        "source": "calculator",
        "batch": 2,
        "train_size": "train_size = 16",
        "workers": 1,
        "tool": "my_tools.py:echo",
        "parser": "my_tools.py:always",
        "extra_nodes": "",
        "scorer": f"{SCORER}:compute_score",
        "on_policy": "true",
    }
    path = tmp_path / "graph.toml"
    path.write_text(textwrap.dedent(GRAPH.format(**{**defaults, **values})))
    return path


@pytest.mark.parametrize(("backend", "workers"), [("local", 1), ("ray", 2)])
def test_train_engine_logprobs_equal_the_rollouts_on_multi_turn_rows(tmp_path, backend, workers):
    graph = write_graph(tmp_path, workers=workers, extra_nodes=OLD_LOGPROB, on_policy="false")
    plan = load_plan(str(graph))
    trainer = Trainer(plan, tmp_path / "run", backend)
    try:
        result = trainer.step(1)
        metrics, batch = result.metrics, result.batch
    finally:
        trainer.close()
    trained = batch["response_mask"].bool()
    tool_tokens = batch["response_attention"].sum() - batch["response_mask"].sum()
    assert int(tool_tokens) > 0 and int(trained.sum()) > 0
    gap = (batch["old_logprobs"] - batch["rollout_logprobs"])[trained].abs().max()
    assert float(gap) < 1e-5
    assert all(info["termination"] == "max_turns" for info in batch["rollout_info"])
    assert metrics["generate/calls_per_request"] == 2.0
    assert "generate/termination/max_turns" in metrics and "timing_s/generate" in metrics


def test_a_verl_parquet_with_tools_kwargs_runs_with_the_answer_check(tmp_path):
    rows = [
        {
            "data_source": "gsm8k",
            "agent_name": "tool_agent",
            "prompt": [
                {"role": "system", "content": "Submit answers with the tool."},
                {"role": "user", "content": f"Question {i}?"},
            ],
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {
                "index": i,
                "need_tools_kwargs": True,
                "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}},
                "interaction_kwargs": {"name": "none"},
            },
        }
        for i, truth in enumerate(["7", "8", "7", "9"])
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    graph = write_graph(
        tmp_path,
        steps=2,
        source="train.parquet",
        batch=4,
        train_size="",
        tool="answer_check",
        parser="my_tools.py:answer_seven",
        scorer=f"{tmp_path}/my_tools.py:tool_reward",
    )
    assert main(["run", str(graph), "--backend", "local"]) in (0, None)
    run_dir = next((tmp_path / "runs").iterdir())
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # every request answers "7": right for the two rows whose create_kwargs say 7
    assert [s["score/mean"] for s in steps] == [0.5, 0.5]
    assert all(s["generate/calls_per_request"] == 2.0 for s in steps)
    trace = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    names = {event["name"] for event in trace}
    assert {"generate", "generate/decode", "generate/tools"} <= names
    sample = json.loads((run_dir / "samples.jsonl").read_text().splitlines()[0])
    assert sample["termination"] == "budget" and sample["conversation"][1]["role"] == "tool"
    assert "Current parsed answer='7'" in sample["conversation"][1]["content"]
    assert sample["response_marked"].startswith("[[")  # the model's turn, trained
    # the turn was cut at max_turn_tokens: its closing eos was added, not sampled (unmarked)
    assert "]]<|im_end|>\n<|im_start|>tool\nCurrent parsed" in sample["response_marked"]
