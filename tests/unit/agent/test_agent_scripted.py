"""flowrl.testing.scripted_request with every kind of interaction the agent node takes: a reply
function or its reference, a verl BaseInteraction class, an instance or its reference, and
verl's interaction YAML (examples/verl_gsm8k's own); a failure inside the interaction raised
where the test sees it; a script that runs out says why."""

import textwrap
from pathlib import Path

import pytest

from flowrl.agent.tools import ToolError
from flowrl.testing import scripted_request

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "verl_gsm8k"

JUDGE = '''
class JudgeInteraction:
    """verl's BaseInteraction shape: right when the last answer holds the ground truth."""

    def __init__(self, config):
        self.config, self.name = config, config.get("name", "judge")
        self.live = {}

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs):
        self.live[instance_id] = ground_truth
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        right = self.live[instance_id] in messages[-1]["content"]
        return right, "Right." if right else "Try again.", float(right), {}

    async def finalize_interaction(self, instance_id, **kwargs):
        del self.live[instance_id]


class Broken(JudgeInteraction):
    async def generate_response(self, instance_id, messages, **kwargs):
        return self.live["nope"]


def reply(messages, ground_truth):
    right = ground_truth in messages[-1]["content"]
    return right, "Right." if right else "Try again.", float(right)


class NoReply:
    pass
'''
YAML = """
interaction:
  - name: strict
    class_name: judge.JudgeInteraction
    config: {}
  - name: lenient
    class_name: judge.JudgeInteraction
    config: {}
"""


@pytest.fixture
def judge(tmp_path, monkeypatch):
    (tmp_path / "judge.py").write_text(JUDGE)
    (tmp_path / "interaction.yaml").write_text(textwrap.dedent(YAML))
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import judge as module

    return importlib.reload(module), tmp_path


def two_turns(base_dir, **interaction):
    """ "70" then "72" against the ground truth 72: the interaction answers both."""
    kwargs = {"ground_truth": "72", **interaction.pop("interaction_kwargs", {})}
    return scripted_request(
        ["#### 70", "#### 72"], base_dir=base_dir, interaction_kwargs=kwargs, **interaction
    ).info()


def test_every_kind_of_interaction_answers_two_turns(judge):
    module, folder = judge
    kinds = {
        "function": {"interaction": module.reply},
        "function reference": {"interaction": "judge.py:reply"},
        "verl class": {"interaction": module.JudgeInteraction},
        "verl class reference": {"interaction": "judge.py:JudgeInteraction"},
        "verl instance": {"interaction": module.JudgeInteraction({"name": "judge"})},
        "verl YAML": {
            "interaction_config": "interaction.yaml",
            "interaction_kwargs": {"name": "lenient"},
        },
    }
    for kind, interaction in kinds.items():
        info = two_turns(folder, **interaction)
        assert info["interaction_turns"] == 2, kind
        assert info["turn_scores"] == [0.0, 1.0], kind
        assert [m["content"] for m in info["messages"]] == [
            "#### 70",
            "Try again.",
            "#### 72",
            "Right.",
        ], kind
        assert info["termination"] == "interaction_done" and info["error"] is None, kind


def test_the_verl_example_interaction_from_its_yaml(judge):
    """examples/verl_gsm8k's Gsm8kInteraction, picked from its YAML by the row's name: wrong,
    then right, as verl's rollout runs it."""
    info = scripted_request(
        ["The answer is #### 70", "#### 72"],
        base_dir=EXAMPLE,
        interaction_config="interaction.yaml",
        interaction_kwargs={"name": "gsm8k", "ground_truth": "72"},
    ).info()
    assert info["interaction_turns"] == 2 and info["turn_scores"] == [0.0, 1.0]
    assert info["messages"][1]["content"].startswith("Your response is incorrect!")
    assert info["messages"][3] == {"role": "user", "content": "Your response is correct!"}


def test_a_failure_inside_the_interaction_is_raised(judge):
    module, folder = judge
    with pytest.raises(KeyError, match="nope") as raised:
        scripted_request(["70"], interaction=module.Broken, interaction_kwargs={}, base_dir=folder)
    assert any("scripted_request" in note for note in raised.value.__notes__)
    info = scripted_request(
        ["70"], interaction="judge.py:Broken", base_dir=folder, raise_errors=False
    ).info()
    assert info["termination"] == "error"
    assert info["error"].startswith("KeyError: 'nope' (") and "judge.py:" in info["error"]


def test_a_yaml_row_must_name_its_interaction(judge):
    _, folder = judge
    with pytest.raises(ValueError, match="'name' key is required"):
        scripted_request(["70"], base_dir=folder, interaction_config="interaction.yaml")
    with pytest.raises(ValueError, match=r"'other' is not one of \['lenient', 'strict'\]"):
        two_turns(
            folder, interaction_config="interaction.yaml", interaction_kwargs={"name": "other"}
        )
    with pytest.raises(ValueError, match="not both"):
        two_turns(folder, interaction="judge.py:reply", interaction_config="interaction.yaml")


def test_a_class_that_is_no_interaction_is_refused_by_name(judge):
    module, folder = judge
    with pytest.raises(ToolError, match='"judge.py:NoReply": a class needs generate_response'):
        scripted_request(["70"], interaction="judge.py:NoReply", base_dir=folder)
    with pytest.raises(ToolError, match='"3" is a int'):
        scripted_request(["70"], interaction=3)


def test_a_script_that_runs_out_says_so(judge):
    """The interaction answers the last scripted turn without ending the request: one more
    turn is asked for, which the script does not have."""
    module, folder = judge
    with pytest.raises(IndexError, match="request 0 asks for turn 3, but its script has 2"):
        scripted_request(
            ["70", "71"], interaction=module.reply, interaction_kwargs={"ground_truth": "72"}
        )


def test_replies_are_counted_per_interaction_over_the_requests_that_have_it(judge):
    from flowrl.agent.rows import interaction_metrics

    _, folder = judge

    def request(turns, name):
        kwargs = {"name": name, "ground_truth": "72"}
        yaml = {"interaction_config": "interaction.yaml", "interaction_kwargs": kwargs}
        return scripted_request(turns, base_dir=folder, **yaml)

    strict = request(["70", "72"], "strict")  # wrong, then right: 2 replies
    lenient = [request(["72"], "lenient"), request(["70", "71", "72"], "lenient")]  # 1 and 3
    alone = scripted_request(["hello"])  # no interaction: not counted
    episodes = [strict, *lenient, alone]
    assert interaction_metrics(episodes) == {
        "interactions/lenient": 2.0,
        "interactions/strict": 2.0,
    }
