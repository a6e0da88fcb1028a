"""The data sampler seam (flowrl/samplers.py): the default draws what runs drew before
it, the pass-rate curriculum prefers its band and is a function of its seed and results, state
survives a checkpoint, and `flowrl check` refuses a sampler that cannot work."""

import json

import numpy as np
import pytest

from flowrl.samplers import PassRateBand, PassRateOptions, UniformSampler
from flowrl.testing import compile_text, graph_problems

GRAPH = """
[run]
steps = 2
[data]
batch_size = 2
{data}
[models.policy]
path = "tiny"
trainable = true
[nodes.generate]
uses = "generate"
model = "policy"
n = 2
[nodes.reward]
uses = "reward.rule"
[nodes.advantage]
uses = "advantage.grpo"
[nodes.update]
uses = "update.policy"
model = "policy"
on_policy = true
kl_loss_coef = 0.0
"""


def test_the_uniform_sampler_draws_each_epochs_permutation_in_batches():
    sampler = UniformSampler(10, seed=3)
    drawn = [sampler.next(4) for _ in range(5)]
    # the order runs had before the seam: per epoch a permutation seeded by seed + epoch,
    # consecutive batches of it, the 2 prompts that do not fill a batch skipped
    first, second = (np.random.default_rng(3 + e).permutation(10).tolist() for e in (0, 1))
    assert drawn == [
        first[:4],
        first[4:8],
        second[:4],
        second[4:8],
        [*np.random.default_rng(5).permutation(10).tolist()[:4]],
    ]
    assert UniformSampler(5, 0, shuffle=False).next(5) == [0, 1, 2, 3, 4]


def test_a_resumed_uniform_sampler_goes_on_where_it_stopped():
    sampler = UniformSampler(10, seed=1)
    for _ in range(3):
        sampler.next(4)
    again = UniformSampler(10, seed=1)
    again.load_state_dict(json.loads(json.dumps(sampler.state_dict())))
    assert [again.next(4) for _ in range(4)] == [sampler.next(4) for _ in range(4)]


def solved(sampler, rates: dict[int, float], samples: int = 8):
    """Tell `sampler` each prompt's results: `rates[i]` of `samples` passes."""
    for index, rate in rates.items():
        passes = round(rate * samples)
        sampler.update([index] * samples, [1.0] * passes + [0.0] * (samples - passes), step=1)


def test_the_pass_rate_band_prefers_prompts_solved_some_of_the_time():
    sampler = PassRateBand(20, seed=0, options=PassRateOptions(outside=0.05, unseen=0.05))
    band = {0: 0.5, 1: 0.25, 2: 0.75}  # in [0.2, 0.8]
    solved(sampler, {**band, 3: 0.0, 4: 1.0, 5: 0.125})  # 3, 4, 5 outside
    counts = np.bincount([i for _ in range(400) for i in sampler.next(2)], minlength=20)
    # weight 1 each for the 3 in the band, 0.05 for each of the 17 others (0.85 in all):
    # a draw's first pick is in the band with probability 3 / 3.85 = 0.78
    in_band = counts[[0, 1, 2]].sum() / counts.sum()
    assert 0.6 < in_band < 0.85, counts
    assert counts[3] < counts[0] / 4 and counts[4] < counts[0] / 4


def test_the_pass_rate_band_draws_distinct_prompts_and_fills_up_when_few_have_weight():
    sampler = PassRateBand(6, seed=0, options=PassRateOptions(outside=0.0, unseen=0.0))
    solved(sampler, {0: 0.5})  # only prompt 0 has weight
    for _ in range(20):
        picked = sampler.next(4)
        assert len(set(picked)) == 4 and 0 in picked


def test_the_pass_rate_is_the_mean_of_the_last_window_scores():
    sampler = PassRateBand(3, seed=0, options=PassRateOptions(window=4))
    sampler.update([1] * 6, [1, 1, 1, 1, 0, 0], step=1)  # the last 4: 1, 1, 0, 0
    rates = sampler.rates()
    assert rates[1] == 0.5 and np.isnan(rates[0]) and np.isnan(rates[2])


def test_the_pass_rate_band_is_a_function_of_seed_and_results_and_resumes_exactly():
    def run(seed, resume_at=None):
        sampler, drawn = PassRateBand(30, seed=seed), []
        for step in range(6):
            if step == resume_at:
                state = json.loads(json.dumps(sampler.state_dict()))
                sampler = PassRateBand(30, seed=seed)
                sampler.load_state_dict(state)
            picked = sampler.next(3)
            drawn.append(picked)
            sampler.update(picked, [float(i % 3 == 0) for i in picked], step)
        return drawn

    assert run(0) == run(0) == run(0, resume_at=3)
    assert run(0) != run(1)


def test_options_are_checked():
    with pytest.raises(ValueError, match="low = 0.9 is above high = 0.5"):
        PassRateOptions(low=0.9, high=0.5)


def test_check_accepts_the_samplers_and_refuses_what_cannot_work(tmp_path):
    ok = 'sampler = "pass_rate"\n[data.sampler_options]\nlow = 0.3'
    plan = compile_text(tmp_path, GRAPH.format(data=ok))
    assert plan.spec.data.sampler_options == {"low": 0.3}
    (problem,) = graph_problems(tmp_path, GRAPH.format(data='sampler = "pass_rat"'))
    assert problem.where == "[data] sampler" and 'did you mean "pass_rate"' in problem.message
    (problem,) = graph_problems(
        tmp_path, GRAPH.format(data='sampler = "pass_rate"\n[data.sampler_options]\nlo = 0.3')
    )
    assert problem.where == "[data.sampler_options]" and 'unknown key "lo"' in problem.message
    (tmp_path / "mine.py").write_text("class Half:\n    def next(self, n):\n        return []\n")
    missing, shape = graph_problems(tmp_path, GRAPH.format(data='sampler = "mine.py:Half"'))
    assert missing.where == shape.where == "[data] sampler"
    assert "has no method update, state_dict, load_state_dict" in missing.message
    assert "cannot be built as Half(size, seed, options)" in shape.message
    (problem,) = graph_problems(tmp_path, GRAPH.format(data='sampler = "nowhere.py:Cls"'))
    assert problem.where == "[data] sampler" and "no file" in problem.message


def docs_sampler(tmp_path):
    """The sampler of docs/data.md ("Choosing the prompts"), written to a user's file."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs/data.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "class HardFirst" in b]
    (tmp_path / "hard_first.py").write_text(block)
    return tmp_path / "hard_first.py"


def test_the_built_in_samplers_and_the_docs_one_pass_check_sampler(tmp_path):
    from flowrl import refs
    from flowrl.api import check_sampler

    check_sampler(UniformSampler, size=10)
    draws = check_sampler(PassRateBand, size=30, batch_size=5)
    assert all(len(set(d)) == 5 for d in draws)
    hard = refs.load(f"{docs_sampler(tmp_path)}:HardFirst")
    draws = check_sampler(hard, size=12)
    # after step 1 the odd prompts (failed) lead: half of each batch is the most failed
    assert all(i % 2 == 1 for i in draws[1][:2])


def test_check_sampler_catches_a_sampler_whose_state_forgets_its_draws():
    class Forgetful(PassRateBand):
        def state_dict(self):
            return {**super().state_dict(), "drawn": 0}

    with pytest.raises(AssertionError, match="a restored sampler drew otherwise"):
        from flowrl.api import check_sampler

        check_sampler(Forgetful, size=30)


def test_a_learning_sampler_without_scores_stops_with_what_to_do(tmp_path):
    import torch

    from flowrl.data.loader import PromptLoader
    from flowrl.protocol import DataProto
    from flowrl.runtime.feed import PromptFeed

    class Dataset:
        def __len__(self):
            return 8

    loader = PromptLoader(Dataset(), 2, 0, sampler=PassRateBand(8, 0))
    feed = PromptFeed(loader, {}, tmp_path)
    rows = DataProto.from_dict({"uid": torch.tensor([0, 0])})
    with pytest.raises(ValueError, match="step 3's rows have no `scores`: add a reward node"):
        feed.told(3, rows)
