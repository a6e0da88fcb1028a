"""What a data sampler of the user's returns, checked where it comes back: its draws (ints,
in range, the right count) in the prompt loader, its state (what JSON holds) when a checkpoint
is made and when a resume reads it back, its class at `flowrl check`; the prompt feed's one
checkpoint format (older ones load); each batch's draws in the run directory's prompts.jsonl."""

import json

import numpy as np
import pytest
import torch

from flowrl.data.loader import PromptDataset, PromptLoader
from flowrl.runtime.feed import DRAWS, PromptFeed
from flowrl.samplers import PassRateBand, SamplerError, UniformSampler, checked_draw
from flowrl.testing import graph_problems, run_tiny, tiny_tokenizer

ROWS = [
    {
        "prompt": [{"role": "user", "content": f"q{i}"}],
        "data_source": "gsm8k",
        "reward_model": {"ground_truth": str(i)},
        "extra_info": {},
    }
    for i in range(10)
]


class Fixed:
    """A sampler that returns what it is given: the probe of each wrong draw."""

    def __init__(self, size, seed, options=None, draw=(), state=None):
        self.draw, self.state = draw, state or {}

    def next(self, batch_size):
        return self.draw

    def update(self, indices, scores, step):
        pass

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state["must_have"]


def loader(draw=(), state=None) -> PromptLoader:
    data = PromptDataset(ROWS, tiny_tokenizer(), 64)
    return PromptLoader(data, 4, 0, sampler=Fixed(10, 0, draw=draw, state=state))


@pytest.mark.parametrize(
    "draw, said",
    [
        ([0, 1, 2, -1], "the index -1, outside the 10 prompts [0, 10)"),
        ([0, 1, 2, 10], "the index 10, outside"),
        ([0, 1, 2], "3 indices"),
        ([0, 1, 2, 3, 4, 5, 6, 7], "8 indices"),
        ([0.0, 1.0, 2.0, 3.0], "not a list of integers"),
        ([True, False, True, False], "not a list of integers"),
        ("0123", "not a list of integers"),
        (None, "not a list of integers"),
    ],
)
def test_a_wrong_draw_stops_naming_the_sampler_and_the_fix(draw, said):
    with pytest.raises(SamplerError) as caught:
        next(loader(draw))
    message = str(caught.value)
    assert said in message and "Fixed (" in message and "test_sampler_contract.py:" in message
    assert "next(4) returned" in message


def test_a_right_draw_of_numpy_integers_is_taken_as_ints():
    assert checked_draw(Fixed(10, 0), np.array([3, 1, 2, 0]), 4, 10) == [3, 1, 2, 0]
    batch = next(loader(np.arange(4)))
    assert batch["uid"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "state, said",
    [
        ({"seen": {1, 2}}, "state['seen'] = {1, 2} (a set)"),
        ({"weights": np.zeros(2)}, "(a ndarray)"),
        ({1: [0]}, "the key 1 (int)"),
        ({"drawn": np.int64(3)}, "(a int64)"),
    ],
)
def test_a_state_json_cannot_hold_stops_the_checkpoint_naming_the_sampler(tmp_path, state, said):
    feed = PromptFeed(loader(state=state), {}, tmp_path)
    with pytest.raises(SamplerError) as caught:
        feed.checkpoint(3)
    message = str(caught.value)
    assert said in message and "Fixed (" in message and "cannot store" in message
    assert "free space" not in message and "a list for a set" in message


def test_a_state_the_sampler_cannot_read_back_stops_the_resume_naming_it(tmp_path):
    feed = PromptFeed(loader(state={"x": 1}), {}, tmp_path)
    saved = json.loads(json.dumps(feed.checkpoint(2)))
    with pytest.raises(SamplerError, match=r"Fixed \(.*load_state_dict\(the checkpoint's state\)"):
        PromptFeed(loader(), {}, tmp_path).load(saved)


def uniform_feed(tmp_path, sampler=None) -> PromptFeed:
    data = PromptDataset(ROWS, tiny_tokenizer(), 64)
    return PromptFeed(PromptLoader(data, 4, 0, sampler=sampler), {}, tmp_path)


def test_the_feed_saves_one_format_and_loads_the_older_ones(tmp_path):
    feed = uniform_feed(tmp_path)
    feed.next(1)
    saved = feed.checkpoint(1)
    assert saved == {"sampler": {"epoch": 0, "position": 1}, "applied": 0, "pending": {}}
    learning = uniform_feed(tmp_path, PassRateBand(10, 0))
    assert set(learning.checkpoint(0)) == {"sampler", "applied", "pending"}
    # older checkpoints: a uniform sampler's state alone; a learning one's without "pending"
    old = uniform_feed(tmp_path)
    old.load({"epoch": 0, "position": 1})
    assert old.next(2)["uid"].tolist() == feed.next(2)["uid"].tolist()
    older_learning = uniform_feed(tmp_path, PassRateBand(10, 0))
    older_learning.load({"sampler": {"drawn": 2, "recent": {"3": [1.0]}}, "applied": 2})
    assert older_learning.applied == 2 and older_learning.loader.sampler.drawn == 2


def test_the_uniform_sampler_is_one_sampler_with_shuffle_its_option(tmp_path):
    from flowrl.samplers import UniformOptions

    assert UniformSampler.Options is UniformOptions and UniformSampler.learns is False
    in_order = UniformSampler(10, 0, UniformOptions(shuffle=False))
    assert in_order.next(4) == [0, 1, 2, 3]
    assert UniformSampler(10, 0, shuffle=False).next(4) == [0, 1, 2, 3]  # the older keyword
    graph = (
        "[data]\nbatch_size = 2\n[data.sampler_options]\nshuffle = 1\n"
        '[models.policy]\npath = "tiny"\n[nodes.generate]\nuses = "generate"\nmodel = "policy"\n'
    )
    (problem,) = graph_problems(tmp_path, graph)
    assert problem.where == "[data.sampler_options]" and "shuffle" in problem.message


def test_a_learning_sampler_is_told_kept_prompt_indices_not_row_numbers(tmp_path):
    from flowrl.protocol import DataProto

    long_row = dict(ROWS[0], prompt=[{"role": "user", "content": "x" * 500}])
    data = PromptDataset([long_row, *ROWS], tiny_tokenizer(), 64)  # row 0 is dropped
    assert len(data) == 10
    sampler = PassRateBand(10, 0)
    feed = PromptFeed(PromptLoader(data, 2, 0, sampler=sampler), {}, tmp_path)
    rows = DataProto.from_dict({"uid": torch.tensor([10, 10]), "scores": torch.ones(2)})
    feed.told(1, rows)
    feed.next(2)
    assert sampler.recent == {9: [1.0, 1.0]}  # the last kept prompt, row 10 of the file


@pytest.mark.parametrize(
    "text, said",
    [
        ("def Mine(size, seed, options):\n    return None\n", "names a function, Mine"),
        (
            "class Mine:\n    Options = dict\n    def __init__(self, size, seed, options=None):"
            "\n        pass\n"
            + "".join(
                f"    def {m}(self, *a):\n        pass\n"
                for m in ("next", "update", "state_dict", "load_state_dict")
            ),
            "its Options, dict",
        ),
        (
            "class Mine:\n    def __init__(self, size):\n        pass\n"
            + "".join(
                f"    def {m}(self, *a):\n        pass\n"
                for m in ("next", "update", "state_dict", "load_state_dict")
            ),
            "cannot be built as Mine(size, seed, options)",
        ),
    ],
)
def test_check_refuses_a_sampler_class_that_misses_the_contract(tmp_path, text, said):
    (tmp_path / "mine.py").write_text(text)
    graph = '[data]\nsampler = "mine.py:Mine"\n[models.policy]\npath = "tiny"\n'
    graph += '[nodes.generate]\nuses = "generate"\nmodel = "policy"\n'
    found = [f"{p.where}: {p.message} | {p.fix}" for p in graph_problems(tmp_path, graph)]
    assert any(p.startswith("[data] sampler") and said in p and "mine.py" in p for p in found)


def test_each_batch_drawn_is_on_record_in_prompts_jsonl(tmp_path):
    from pathlib import Path

    graph = Path(__file__).resolve().parents[3] / "graphs/grpo.toml"
    run = run_tiny(graph, tmp_path, **{"run.steps": 3})
    lines = [json.loads(x) for x in (run.run_dir / DRAWS).read_text().splitlines()]
    assert [(x["step"], x["round"]) for x in lines] == [(1, 0), (2, 0), (3, 0)]
    assert all(len(x["indices"]) == 2 and x["indices"] == x["rows"] for x in lines)
    drawn = [i for x in lines for i in x["indices"]]
    assert len(set(drawn)) == 6  # one epoch's permutation: no prompt twice


def test_the_testing_pages_sampler_test_passes_on_the_data_pages_sampler(tmp_path):
    import importlib.util
    import re
    import sys
    from pathlib import Path

    docs = Path(__file__).resolve().parents[3] / "docs"
    data_page, testing_page = (docs / "data.md").read_text(), (docs / "testing.md").read_text()
    (sampler,) = [
        b for b in re.findall(r"```python\n(.*?)```", data_page, re.S) if "class HardFirst" in b
    ]
    (test,) = [
        b for b in re.findall(r"```python\n(.*?)```", testing_page, re.S) if "hard_first" in b
    ]
    (tmp_path / "hard_first.py").write_text(sampler)
    (tmp_path / "test_hard_first.py").write_text(test)
    sys.path.insert(0, str(tmp_path))
    try:
        spec = importlib.util.spec_from_file_location(
            "test_hard_first", tmp_path / "test_hard_first.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.test_hard_first_is_a_sampler()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("hard_first", None)
