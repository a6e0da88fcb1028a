"""`flowrl check` of an agent_program node: one of program and command, a program file that
exists. No torch, no server."""

from pathlib import Path

import pytest

import flowrl.nodes
from flowrl.testing import graph_problems

NODES = str(Path(__file__).resolve().parents[4] / "nodes")
if NODES not in flowrl.nodes.__path__:  # an editable install of another checkout
    flowrl.nodes.__path__.insert(0, NODES)

GRAPH = """
[data]
source = "calculator"
batch_size = 2
[models.policy]
path = "tiny"
trainable = true
[nodes.generate]
uses = "agent_program"
model = "policy"
n = 2
{how}
[nodes.reward]
uses = "reward.rule"
[nodes.advantage]
uses = "advantage.grpo"
[nodes.update_policy]
uses = "update.policy"
model = "policy"
on_policy = true
"""


@pytest.mark.parametrize(
    "how, says",
    [
        ("", "give exactly one of program, command and env"),
        (
            'program = "a.py:f"\ncommand = "python a.py"',
            "give exactly one of program, command and env",
        ),
        ('program = "agent.py"', 'is not "file.py:function"'),
        ('program = "missing.py:solve"', "no file"),
    ],
)
def test_program_params_are_checked(tmp_path, how, says):
    (problem,) = graph_problems(tmp_path, GRAPH, how=how)
    assert "[nodes.generate]" in str(problem) and says in str(problem)
