"""Run shipped graphs on tiny random models, a few steps, no download."""

from pathlib import Path

import pytest

from flowrl import testing
from flowrl.cli import load_plan
from flowrl.testing import update_batch

ROOT = Path(__file__).resolve().parents[2]


def tiny_overrides(graph: str, tmp_path, **extra) -> list[str]:
    """flowrl.testing.tiny_overrides for a shipped graph, run dirs under tmp_path."""
    return testing.tiny_overrides(ROOT / "graphs" / graph, tmp_path, **extra)


@pytest.fixture
def tiny_plan(tmp_path):
    def make(graph: str, **extra):
        return load_plan(str(ROOT / "graphs" / graph), tiny_overrides(graph, tmp_path, **extra))

    return make


def fixed_batch(rows=7, p=6, t=5):
    """A GRPO update's batch: the random policy-update rows, with reference log-probs in place
    of old ones (grpo.toml's update is on-policy, with a KL loss)."""
    import torch

    batch = update_batch(b=rows, p=p, t=t)
    batch = batch.select([k for k in batch.keys() if k != "old_logprobs"])
    batch["ref_logprobs"] = torch.full((rows, t), -4.0)
    batch.meta.update(step=1, seed=0)
    return batch
