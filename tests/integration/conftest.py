"""Run shipped graphs on tiny random models, a few steps, no download."""

from pathlib import Path

import pytest

from flowrl import testing
from flowrl.cli import load_plan

ROOT = Path(__file__).resolve().parents[2]


def tiny_overrides(graph: str, tmp_path, **extra) -> list[str]:
    """flowrl.testing.tiny_overrides for a shipped graph, run dirs under tmp_path."""
    return testing.tiny_overrides(ROOT / "graphs" / graph, tmp_path, **extra)


@pytest.fixture
def tiny_plan(tmp_path):
    def make(graph: str, **extra):
        return load_plan(str(ROOT / "graphs" / graph), tiny_overrides(graph, tmp_path, **extra))

    return make
