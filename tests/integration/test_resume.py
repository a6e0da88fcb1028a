"""A run stopped after a checkpoint and resumed ends with the same parameters as one that
was never stopped."""

import pytest
import torch

from flowrl.runtime import checkpoint
from flowrl.runtime.controller import Trainer
from flowrl.testing import parameters

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models


class Stop(Exception):
    pass


def final_params(trainer):
    return parameters(trainer.executor.workers["main"][0], "policy")


def test_resume_matches_uninterrupted_run(tiny_plan, tmp_path):
    extra = {"run.steps": 4, "run.save_every": 2}
    plan = tiny_plan("grpo.toml", **extra)

    straight = Trainer(plan, tmp_path / "a", "local")
    straight.fit()
    expected = final_params(straight)

    stopped = Trainer(plan, tmp_path / "b", "local")
    original = stopped.step

    def step_then_die(step):
        if step == 3:
            raise Stop  # as if killed during step 3, after step 2's checkpoint
        return original(step)

    stopped.step = step_then_die
    with pytest.raises(Stop):
        stopped.fit()
    saved = checkpoint.latest(tmp_path / "b")
    assert saved.name == "step_000002"
    files = {p.name: p.read_bytes() for p in saved.iterdir()}

    resumed = Trainer(plan, tmp_path / "b", "local")
    resumed.fit(resume=True)
    for key, value in expected.items():
        torch.testing.assert_close(final_params(resumed)[key], value, rtol=0, atol=0)
    # the checkpoint it resumed from is untouched (only newer ones were added)
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == files
