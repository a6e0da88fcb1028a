"""What a rollout backend of the user's must be and return, checked at the boundary: its class
at `flowrl check` (flowrl/contracts.py, flowrl/backends.py), each result where it comes back
(flowrl/engines/rollout.py `checked_result`, wrapped around every backend's `generate`)."""

import math

import numpy as np
import pytest

from flowrl.engines.rollout import Request, Result, RolloutResultError, checked_result
from flowrl.testing import graph_problems

GRAPH = """
[models.policy]
path = "tiny"
rollout = "mine.py:Mine"
[nodes.generate]
uses = "generate"
model = "policy"
"""

GOOD = """
import attrs
from flowrl.api import Result, RolloutBase

@attrs.frozen
class Opts:
    x: int = 1

class Mine(RolloutBase):
    Options = Opts

    async def generate(self, request):
        return Result([], [], "length")
"""


def problems(folder, text: str) -> list[str]:
    """What check says of GRAPH with `text` as mine.py (a file loads once per path: a folder
    per text)."""
    folder.mkdir()
    (folder / "mine.py").write_text(text)
    return [f"{p.where}: {p.message} | {p.fix}" for p in graph_problems(folder, GRAPH)]


@pytest.mark.parametrize(
    "old, new, said",
    [
        (
            "class Mine(RolloutBase):",
            "def Mine(*a, **k):\n    pass\nclass Other(RolloutBase):",
            "names a function, Mine",
        ),
        (
            "    async def generate(self, request):",
            "    def generate(self, request):",
            "generate is not async",
        ),
        ("@attrs.frozen\nclass Opts:", "class Opts:", "its Options, Opts"),
        (
            "class Mine(RolloutBase):\n    Options = Opts\n",
            "class Mine(RolloutBase):\n    Options = Opts\n"
            "    def __init__(self, module, tokenizer):\n        pass\n",
            "cannot be built as Mine(module, tokenizer, device, options=..., seed=..., where=...)",
        ),
        (
            "class Mine(RolloutBase):",
            "class Mine:",
            "has no method run, release, offload, reload, sync_weights",
        ),
    ],
)
def test_check_refuses_a_backend_class_that_misses_the_contract(tmp_path, old, new, said):
    with pytest.raises(AssertionError, match="the graph compiled"):
        problems(tmp_path / "good", GOOD)
    assert old in GOOD
    found = problems(tmp_path / "bad", GOOD.replace(old, new))
    assert any(said in p and p.startswith("[models.policy] rollout") for p in found), found
    assert all("mine.py" in p for p in found if said in p)


REQUEST = Request([1, 2, 3], max_new_tokens=4, forced=(7,))


@pytest.mark.parametrize(
    "result, said",
    [
        ({"ids": [7], "logprobs": [-1.0]}, "a dict, not a Result"),
        (Result([7.0, 8.5], [-1.0, -1.0], "stop"), "ids of types ['float']"),
        (Result([7, 8], [-1.0], "stop"), "2 ids with 1 log-probs"),
        (Result([7, 8, 9, 10, 11], [-1.0] * 5, "length"), "5 ids for max_new_tokens = 4"),
        (Result([7, -1], [-1.0, -1.0], "stop"), "the id -1"),
        (Result([7, 100], [-1.0, -1.0], "stop"), "the id 100, outside the vocabulary [0, 100)"),
        (Result([8, 7], [-1.0, -1.0], "stop"), "where the request forced [7]"),
        (Result([7, 8], [-1.0, math.nan], "stop"), "the log-prob nan"),
        (Result([7, 8], [-1.0, 0.5], "stop"), "the log-prob 0.5"),
        (Result([7, 8], [-1.0, -1.0], "eos"), 'the finish reason "eos"'),
        (Result([7, 8], ["a", "b"], "stop"), "log-probs that are not numbers"),
    ],
)
def test_a_result_that_breaks_the_contract_is_refused(result, said):
    with pytest.raises(ValueError, match=None) as caught:
        checked_result(REQUEST, result, vocab=100)
    assert said in str(caught.value) and caught.value.fix


def test_a_good_result_comes_back_as_plain_ints_and_floats():
    got = checked_result(REQUEST, Result(np.array([7, 8]), np.array([-0.5, -1.0]), "stop"), 100)
    assert got == Result([7, 8], [-0.5, -1.0], "stop")
    assert all(type(i) is int for i in got.ids) and all(type(v) is float for v in got.logprobs)


def test_every_backend_made_by_make_rollout_is_checked_naming_its_file(tmp_path):
    from flowrl.engines import make_rollout
    from flowrl.engines.batch import generate_batch
    from flowrl.testing import tiny_model, tiny_tokenizer

    bad = GOOD.replace('return Result([], [], "length")', 'return Result([3, 4], [-1.0], "stop")')
    (tmp_path / "mine.py").write_text(bad)
    backend = make_rollout("mine.py:Mine", tiny_model(), tiny_tokenizer(), base_dir=tmp_path)
    prompts = np.ones((1, 3), dtype=np.int64)
    import torch

    with pytest.raises(RolloutResultError) as caught:
        generate_batch(backend, torch.tensor(prompts), torch.ones(1, 3), max_new_tokens=4)
    message = str(caught.value)
    assert 'rollout backend "mine.py:Mine": Mine (' in message and "mine.py:" in message
    assert "2 ids with 1 log-probs" in message and "one log-prob per sampled id" in message


SERVER = """
from flowrl.api import Result, ServerRollout

class Mine(ServerRollout):
    weights_as = "directory"

    def load_weights(self, directory):
        pass

    async def generate(self, request):
        return Result([], [], "length")
"""


@pytest.mark.parametrize(
    "old, new, said",
    [
        ('weights_as = "directory"', 'weights_as = "disk"', "weights_as = 'disk'"),
        ('weights_as = "directory"', 'weights_as = "buckets"', "but no load_weight_buckets"),
        ("    def load_weights(self, directory):\n        pass\n", "", "but no load_weights"),
    ],
)
def test_check_refuses_a_server_backend_without_its_route_for_the_weights(tmp_path, old, new, said):
    with pytest.raises(AssertionError, match="the graph compiled"):
        problems(tmp_path / "good", SERVER)
    found = problems(tmp_path / "bad", SERVER.replace(old, new))
    assert any(said in p and "A server backend" in p for p in found), found
