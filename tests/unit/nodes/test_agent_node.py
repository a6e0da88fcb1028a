"""The agent node: its worker on the tiny model (keys, shapes, masks, samples, seeding), its
`check` hook (every limit, tools, parser, interaction, the chat template) through `flowrl
check`, and reward.rule handing the rollout's record to the scorer under verl's names."""

import textwrap
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch

import flowrl
from flowrl.engines import HFRollout
from flowrl.errors import GraphErrors
from flowrl.hooks import CheckContext
from flowrl.nodes import agent
from flowrl.nodes.reward.rule import run as rule_run
from flowrl.protocol import DataProto
from flowrl.testing import tiny_model, tiny_tokenizer

TOOLS = '''
def echo(text: str) -> str:
    """Echo the text back.

    Args:
        text: anything.
    """
    return "echo:" + text


def always(text):
    return [("echo", {"text": text[:3]})]
'''


@pytest.fixture
def tools_dir(tmp_path):
    (tmp_path / "my_tools.py").write_text(TOOLS)
    return tmp_path


def batch_of(tokenizer, questions, base_dir, **meta):
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(len(i) for i in ids)
    prompts = torch.full((len(ids), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(prompts)
    for k, row in enumerate(ids):
        prompts[k, width - len(row) :], mask[k, width - len(row) :] = torch.tensor(row), 1
    extra = [{"agent_name": "tool_agent"}, {"agent_name": "single_turn_agent"}][: len(ids)]
    return DataProto.from_dict(
        {"prompts": prompts, "prompt_mask": mask},
        {"raw_prompt": [[{"role": "user", "content": q}] for q in questions], "extra_info": extra},
        {"base_dir": str(base_dir), "seed": 0, "step": 1, **meta},
    )


def worker(params):
    tokenizer = tiny_tokenizer()
    return agent.AgentWorker(HFRollout(tiny_model(seed=1), tokenizer), params)


PARAMS = agent.Params(
    n=2,
    max_new_tokens=80,
    max_turn_tokens=5,
    max_assistant_turns=3,
    tools=("my_tools.py:echo",),
    parser="my_tools.py:always",
)


def test_the_worker_returns_multi_turn_rows(tools_dir):
    batch = batch_of(tiny_tokenizer(), ["Hi?", "Bye?"], tools_dir)
    out, metrics, phases = worker(PARAMS)(batch)
    assert set(out) == set(agent.SPEC.writes)
    # decode and tool spans go to the trace through the third element, not the metrics
    assert {name for name, _, _ in phases} == {"decode", "tools"}
    assert all(start <= end for _, start, end in phases)
    rows, t = out["responses"].shape
    assert rows == 4 and out["rollout_logprobs"].shape == (4, t)
    mask, attention = out["response_mask"], out["response_attention"]
    assert bool((mask <= attention).all())
    infos = out["rollout_info"]
    # row 0's samples call echo every turn; row 1 is "single_turn_agent": no tools
    for k in (0, 1):
        assert infos[k]["termination"] == "max_turns" and infos[k]["tool_calls"] == 2
        assert int((attention[k] - mask[k]).sum()) == infos[k]["tool_tokens"] > 0
        assert infos[k]["messages"][1] == {
            "role": "tool",
            "content": "echo:" + infos[k]["messages"][0]["content"][:3],
        }
    for k in (2, 3):
        assert infos[k]["tool_calls"] == 0 and int((attention[k] - mask[k]).sum()) == 0
    assert (out["rollout_logprobs"][mask == 0] == 0).all()
    assert out["response_text"][0] == "\n".join(
        infos[0]["messages"][i]["content"] for i in (0, 2, 4)
    )
    assert metrics["termination/max_turns"] == 0.5 and metrics["call_rate"] == 0.5
    assert metrics["calls_per_request"] == 1.0 and metrics["num_turns_max"] == 3.0


def test_the_worker_is_seeded_by_step(tools_dir):
    tokenizer = tiny_tokenizer()
    first, _, _ = worker(PARAMS)(batch_of(tokenizer, ["Hi?"], tools_dir))
    again, _, _ = worker(PARAMS)(batch_of(tokenizer, ["Hi?"], tools_dir))
    other, _, _ = worker(PARAMS)(batch_of(tokenizer, ["Hi?"], tools_dir, step=2))
    assert torch.equal(first["responses"], again["responses"])
    assert not torch.equal(first["responses"], other["responses"])


def context(base_dir, model_path="tiny"):
    return CheckContext("rollout", 8, 2, 4, 1, str(base_dir), model_path)


QWEN_TEMPLATE = Path(__file__).parents[2] / "data" / "qwen2_5_tools.jinja"


def test_check_accepts_a_good_node(tools_dir):
    # the tiny model's template drops tools=: a warning that names both fixes
    (warning,) = agent.check(PARAMS, context(tools_dir))
    assert warning.warning and "ignores tools=" in warning.message
    assert "chat_template" in warning.message and "system_prompt" in warning.message
    tag = attrs.evolve(
        PARAMS, tools=("calculator",), parser="tag", chat_template=str(QWEN_TEMPLATE)
    )
    assert agent.check(tag, context(tools_dir)) == []
    described = attrs.evolve(PARAMS, system_prompt="Tools: {tools}")
    assert agent.check(described, context(tools_dir)) == []


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"tools": ("nope.py:echo",)}, 'tools: tool "nope.py:echo": no file'),
        ({"parser": "json"}, 'parser = "json"'),
        ({"parser": "my_tools.py:missing"}, 'has no "missing"'),
        ({"interaction": "my_tools.py:reply"}, 'has no "reply"'),
        ({"tools": ("python", "answer_check"), "parser": "tag"}, None),
    ],
)
def test_check_reports_each_bad_param(tools_dir, change, says):
    # ranges and enumerations are the params' own validators (flowrl/params.py):
    # test_params_state_their_rules below; the check hook adds what needs files and names
    findings = agent.check(attrs.evolve(PARAMS, **change), context(tools_dir))
    messages = [f.message for f in findings if not f.warning]
    if says is None:  # the tag parser with one-argument tools only
        assert messages == []
    else:
        assert any(says in m for m in messages), messages


def test_check_warns_of_interact_on_cut_without_an_interaction(tools_dir):
    p = attrs.evolve(PARAMS, interact_on_cut=True)
    (finding,) = [f for f in agent.check(p, context(tools_dir)) if "interact_on_cut" in f.message]
    assert finding.warning and "without an interaction does nothing" in finding.message
    (tools_dir / "user.py").write_text("def reply(messages):\n    return True, 'ok', 0.0\n")
    p = attrs.evolve(p, interaction="user.py:reply")
    assert not [f for f in agent.check(p, context(tools_dir)) if "interact_on_cut" in f.message]


def test_check_reports_a_tag_parser_over_a_tool_of_two_arguments(tools_dir):
    (tools_dir / "two.py").write_text(
        'def add(a: int, b: int) -> str:\n    """Add.\n\n    Args:\n        a: one.\n'
        '        b: two.\n    """\n    return str(a + b)\n'
    )
    p = attrs.evolve(PARAMS, tools=("two.py:add",), parser="tag")
    assert "tool add requires 2" in agent.check(p, context(tools_dir))[0].message


def test_flowrl_check_runs_the_template_check_without_loading_weights(tools_dir, monkeypatch):
    graph = tools_dir / "g.toml"
    graph.write_text(
        textwrap.dedent(
            """
            [data]
            batch_size = 2
            [models.policy]
            path = "tiny"
            trainable = true
            [pools.main]
            workers = 1
            [nodes.rollout]
            uses = "agent"
            model = "policy"
            n = 2
            tools = ["my_tools.py:echo"]
            parser = "my_tools.py:always"
            max_assistant_turns = 0
            [nodes.reward]
            uses = "reward.rule"
            rollout_info = true
            [nodes.advantage]
            uses = "advantage.grpo"
            [nodes.update]
            uses = "update.policy"
            model = "policy"
            on_policy = true
            """
        )
    )
    with pytest.raises(
        GraphErrors, match="max_assistant_turns. = 0 is not allowed: must be from 1"
    ):
        flowrl.compile(graph)
    from flowrl.agent import checks

    monkeypatch.setattr(checks, "_template", lambda *a: ["a template that rewrites"])
    text = graph.read_text().replace("max_assistant_turns = 0\n", "max_turn_tokens = 900\n")
    graph.write_text(text)
    with pytest.raises(GraphErrors, match="chat template: a template that rewrites"):
        flowrl.compile(graph)
    monkeypatch.setattr(checks, "_template", lambda *a: [])
    plan = flowrl.compile(graph)
    assert plan.spec.nodes["rollout"].params.tools == ("my_tools.py:echo",)
    assert any("max_turn_tokens = 900 exceeds" in w for w in plan.warnings)


def test_flowrl_check_says_when_the_python_tool_cannot_be_confined(tools_dir, monkeypatch):
    from flowrl.agent import checks
    from flowrl.agent.tools import sandbox

    monkeypatch.setattr(checks, "_template", lambda *a: [])
    graph = tools_dir / "g.toml"
    graph.write_text(
        '[data]\nbatch_size = 2\n[models.policy]\npath = "tiny"\ntrainable = true\n'
        '[pools.main]\nworkers = 1\n[nodes.rollout]\nuses = "agent"\nmodel = "policy"\n'
        'n = 2\ntools = ["python"]\n[nodes.reward]\nuses = "reward.rule"\n'
        '[nodes.advantage]\nuses = "advantage.grpo"\n[nodes.update]\n'
        'uses = "update.policy"\nmodel = "policy"\non_policy = true\n'
    )
    simulated = sandbox.Confinement(False, "simulated: user namespaces off")
    monkeypatch.setattr(sandbox, "confinement", lambda: simulated)
    monkeypatch.setattr(sandbox, "_NOTICE", [])
    plan = flowrl.compile(graph)
    (said,) = [w for w in plan.warnings if "cannot confine" in w]
    assert "simulated: user namespaces off" in said and "credentials" in said
    assert sandbox._NOTICE  # the run's first call does not say it again
    text = graph.read_text().replace(
        'tools = ["python"]', 'tools = ["python"]\nsandbox = "required"'
    )
    graph.write_text(text)
    with pytest.raises(GraphErrors) as refused:
        flowrl.compile(graph)
    report = str(refused.value)
    assert "[nodes.rollout]" in report and 'sandbox = "required", but' in report
    assert "user namespaces" in report and 'sandbox = "auto"' in report  # the fix
    monkeypatch.setattr(sandbox, "confinement", lambda: sandbox.Confinement(True))
    assert not [w for w in flowrl.compile(graph).warnings if "confine" in w]


def test_reward_rule_hands_the_rollout_record_to_the_scorer(tmp_path):
    (tmp_path / "s.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return extra_info['num_turns'] + sum(extra_info['tool_rewards'])"
        " + extra_info['rollout_reward_scores'].get('t', 0) + extra_info['index']\n"
    )
    from flowrl.nodes.reward import rule

    params = rule.Params(scorer=f"{tmp_path}/s.py:compute_score", rollout_info=True)
    info = {
        "num_turns": 3,
        "tool_rewards": [0.5, -0.05],
        "turn_scores": [],
        "rollout_reward_scores": {"t": 10.0},
        "messages": [],
    }
    batch = DataProto.from_dict(
        {},
        {
            "response_text": np.array(["x"], dtype=object),
            "ground_truth": ["1"],
            "data_source": ["s"],
            "extra_info": [{"index": 100}],
            "rollout_info": [info],
        },
    )
    scores, _ = rule_run(batch, params)
    assert float(scores["scores"][0]) == pytest.approx(3 + 0.45 + 10 + 100)
    assert rule.SPEC.reads_for(params)[-1] == "rollout_info"
    assert "rollout_info" not in rule.SPEC.reads_for(rule.Params())


def test_reward_tools_adds_step_and_final_rewards_and_a_call_bonus():
    from flowrl.nodes.reward.tools import tool_scores

    infos = [
        {"calls": [{"status": "ok"}], "tool_rewards": [0.0, -0.05], "rollout_reward_scores": {}},
        {"calls": [{"status": "invalid"}], "tool_rewards": [], "rollout_reward_scores": {"t": 1}},
        {"calls": [], "tool_rewards": [], "rollout_reward_scores": {}},
    ]
    # 1 - 0.05 + 0.1 bonus; 0 + 0.5 * 1 (no bonus: the call did not run); 1 unchanged
    shaped, bad = tool_scores([1.0, 0.0, 1.0], infos, coef=1.0, final_coef=0.5, call_bonus=0.1)
    assert shaped == pytest.approx([1.05, 0.5, 1.0]) and bad == []


def test_reward_tools_wires_after_a_renamed_rule_reward(tools_dir):
    graph = tools_dir / "g.toml"
    graph.write_text(
        textwrap.dedent(
            """
            [data]
            batch_size = 2
            [models.policy]
            path = "tiny"
            trainable = true
            [pools.main]
            workers = 1
            [nodes.generate]
            uses = "agent"
            model = "policy"
            n = 2
            tools = ["calculator"]
            parser = "tag"
            [nodes.reward]
            uses = "reward.rule"
            rename = { scores = "rule_scores" }
            [nodes.tool_reward]
            uses = "reward.tools"
            call_bonus = 0.1
            [nodes.advantage]
            uses = "advantage.grpo"
            [nodes.update]
            uses = "update.policy"
            model = "policy"
            on_policy = true
            """
        )
    )
    plan = flowrl.compile(graph)
    assert plan.graph.writers["scores"] == "tool_reward"
    assert plan.graph.writers["rule_scores"] == "reward"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"max_assistant_turns": 0}, "max_assistant_turns = 0 is not allowed: must be from 1"),
        ({"tool_timeout_s": 0.0}, "tool_timeout_s = 0.0 is not allowed: must be > 0"),
        ({"max_invalid_calls": -1}, "max_invalid_calls = -1 is not allowed: must be from 0"),
        ({"obs_role": "system"}, "obs_role = 'system' is not allowed: must be one of \"tool\""),
        ({"solution": "all"}, "solution = 'all' is not allowed: must be one of \"assistant\""),
    ],
)
def test_params_state_their_rules(change, says):
    with pytest.raises(ValueError) as info:
        attrs.evolve(PARAMS, **change)
    assert says in str(info.value)


def test_failed_requests_reach_samples_and_the_log_with_their_rows(tmp_path):
    import io
    import json

    from flowrl.runtime import step_log

    infos = [
        {"termination": "stop", "error": None, "messages": [], "trained_spans": [["a", 1]]},
        {"termination": "error", "error": "TypeError: bad", "messages": [], "trained_spans": []},
        {
            "termination": "stop",
            "error": None,
            "release_errors": ["t: release: OSError: gone"],
            "messages": [],
            "trained_spans": [],
        },
    ]
    batch = DataProto.from_dict(
        {"uid": torch.tensor([7, 8, 9]), "response_mask": torch.tensor([[1], [0], [1]])},
        {"rollout_info": infos, "prompt_text": ["p0", "p1", "p2"]},
    )
    assert step_log.failed_requests(batch) == [1, 2]
    lines = step_log.failure_lines(batch, [1, 2])
    assert lines[0] == "  request 1 (row uid 8, error): TypeError: bad | 'p1'"
    assert "OSError: gone" in lines[1]
    out = io.StringIO()
    step_log.log_samples(out, 3, batch, count=1)  # one logged row, plus both failures
    rows = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [r.get("error") for r in rows] == [None, "TypeError: bad", "t: release: OSError: gone"]
    assert not step_log.trained_nothing(batch)
    batch["response_mask"] = torch.zeros(3, 1, dtype=torch.long)
    assert step_log.trained_nothing(batch)
