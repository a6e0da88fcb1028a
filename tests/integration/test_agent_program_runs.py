"""An agent program written with the `openai` SDK trains through the endpoint
(nodes/agent_program.py): a function by reference and a command, on the tiny model."""

from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

import flowrl.nodes  # noqa: E402
from flowrl.testing import run_tiny, write_graph  # noqa: E402

pytestmark = pytest.mark.slow

NODES = str(Path(__file__).resolve().parents[2] / "nodes")
if NODES not in flowrl.nodes.__path__:  # an editable install of another checkout
    flowrl.nodes.__path__.insert(0, NODES)

AGENT = '''
import openai


def solve(base_url, api_key, row):
    """Two turns: an answer, a nudge, a second answer; the last is the answer."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(row["prompt"])
    for nudge in ("Are you sure?", None):
        r = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        if nudge:
            messages.append({"role": "user", "content": nudge})
    return r.choices[0].message.content
'''

COMMAND_AGENT = """
import json, os, sys
import openai

row = json.load(sys.stdin)
client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the node
r = client.chat.completions.create(model="policy", messages=row["prompt"], max_tokens=6)
print(json.dumps({"reward": float(len(r.choices[0].message.content) % 2)}))
"""

GRAPH = """
[run]
steps = 2
seed = 0

[data]
source = "calculator"
batch_size = 2

[models.policy]
path = "smollm2-135m-instruct"
trainable = true

[pools.main]
workers = 1

[nodes.generate]
uses = "agent_program"
model = "policy"
n = 2
max_new_tokens = 16
{how}

{reward}

[nodes.advantage]
uses = "advantage.grpo"

[nodes.update_policy]
uses = "update.policy"
model = "policy"
kl_loss_coef = 0.0
on_policy = true              # the rollout's log-probs are the old policy's
"""

RULE = '[nodes.reward]\nuses = "reward.rule"'


def test_a_python_agent_function_trains(tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    graph = write_graph(tmp_path, GRAPH, how='program = "agent.py:solve"', reward=RULE)
    run = run_tiny(graph, tmp_path / "runs")
    steps = [m for m in run.metrics if m.get("step", 0) > 0 and "generate/episodes/ok" in m]
    assert steps and all(m["generate/episodes/ok"] == 1.0 for m in steps)
    assert all(m["generate/calls_per_episode"] == 2.0 for m in steps)
    assert all(m["generate/response_length"] > 0 for m in steps)  # sampled tokens trained
    assert any(m.get("update_policy/grad_norm", 0) > 0 for m in run.metrics)


def test_a_command_agent_returning_rewards_trains(tmp_path):
    (tmp_path / "agent_cmd.py").write_text(COMMAND_AGENT)
    how = 'command = "python agent_cmd.py"\nreturns = "reward"'
    graph = write_graph(tmp_path, GRAPH, how=how, reward="")
    run = run_tiny(graph, tmp_path / "runs")
    steps = [m for m in run.metrics if "generate/episodes/ok" in m]
    assert steps and all(m["generate/episodes/ok"] == 1.0 for m in steps)


def test_flowrl_serve_loads_a_runs_checkpoint(tmp_path):
    """`flowrl serve RUN_DIR`: the run's trained weights (exported from its checkpoint), and
    the endpoint answers with them."""
    import torch

    from flowrl.engines import HFRollout
    from flowrl.serve.app import Keys
    from flowrl.serve.endpoint import Endpoint
    from flowrl.serve.server import Server, load_served
    from flowrl.testing import tiny_model

    (tmp_path / "agent.py").write_text(AGENT)
    graph = write_graph(tmp_path, GRAPH, how='program = "agent.py:solve"', reward=RULE)
    run = run_tiny(graph, tmp_path / "runs")
    module, tokenizer, context, name = load_served(str(run.run_dir))
    start = tiny_model().state_dict()
    trained = module.state_dict()
    assert any(not torch.equal(start[k], trained[k]) for k in start)  # the trained weights
    assert name == run.run_dir.name and context > 0
    endpoint = Endpoint(HFRollout(module, tokenizer), model_name=name)
    with Server(endpoint, Keys()) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0)
        r = client.completions.create(model=name, prompt="2 + 2 =", max_tokens=3, seed=0)
        assert r.usage.completion_tokens <= 3 and r.choices[0].finish_reason in ("stop", "length")


def test_the_shipped_openai_agent_graph_runs(tmp_path):
    """graphs/grpo_openai_agent.toml on the tiny model: its agent (the openai SDK, tool calls
    parsed by the endpoint) completes every episode and the update trains."""
    graph = Path(__file__).resolve().parents[2] / "graphs/grpo_openai_agent.toml"
    run = run_tiny(graph, tmp_path, **{"data.batch_size": 2, "nodes.generate.n": 2})
    steps = [m for m in run.metrics if "generate/episodes/ok" in m]
    assert steps and all(m["generate/episodes/ok"] == 1.0 for m in steps)
    assert all(m["generate/calls_per_episode"] >= 1.0 for m in steps)
    assert any(m.get("update_policy/grad_norm", 0) > 0 for m in run.metrics)


REWRITER = '''
import openai


def solve(base_url, api_key, row):
    """Two calls; the second sends the first answer rewritten (as a template that drops a
    reasoning block would): a break in the history."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(row["prompt"])
    r = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    messages.append({"role": "assistant", "content": "(rewritten)"})
    messages.append({"role": "user", "content": "Again?"})
    r = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    return r.choices[0].message.content
'''


def test_an_episode_whose_history_is_rewritten_trains_every_segment(tmp_path):
    """max_segments = 2: each episode is two rows, its two segments, both trained (nothing
    dropped), and GRPO's groups are taken over episodes (episode_share)."""
    (tmp_path / "agent.py").write_text(REWRITER)
    how = 'program = "agent.py:solve"\nmax_segments = 2'
    graph = write_graph(tmp_path, GRAPH, how=how, reward=RULE)
    run = run_tiny(graph, tmp_path / "runs", **{"run.val_size": 0})
    steps = [m for m in run.metrics if "generate/episodes/ok" in m]
    assert steps and all(m["generate/episodes/ok"] == 1.0 for m in steps)
    assert all(m["generate/segments_per_episode"] == 2.0 for m in steps)
    assert all(m["generate/segments_dropped"] == 0.0 for m in steps)
    assert any(m.get("update_policy/grad_norm", 0) > 0 for m in run.metrics)
    # the default, one row per episode: the second segment is counted, not trained
    graph = write_graph(tmp_path, GRAPH, how='program = "agent.py:solve"', reward=RULE)
    run = run_tiny(graph, tmp_path / "runs1", **{"run.val_size": 0})
    steps = [m for m in run.metrics if "generate/episodes/ok" in m]
    assert all(m["generate/segments_dropped"] == 1.0 for m in steps)


def test_an_agent_programs_run_repeats_whatever_order_its_calls_arrive_in(tmp_path):
    """Calls that give no seed are seeded from their episode's name and call count, not from
    the order the concurrent episodes' calls reach the endpoint: two runs train alike."""
    (tmp_path / "agent.py").write_text(AGENT)
    graph = write_graph(tmp_path, GRAPH, how='program = "agent.py:solve"', reward=RULE)
    runs = [run_tiny(graph, tmp_path / f"runs{k}") for k in range(2)]
    keys = ("score/mean", "update_policy/grad_norm", "generate/response_length")
    seen = [[{k: m.get(k) for k in keys} for m in run.metrics] for run in runs]
    assert seen[0] == seen[1]
