"""docs/debugging.md's worked example: its graph compiles, its node has the bug the page
debugs (only at steps that are a multiple of stats_every), and the page's fix works."""

import re
import sys
from pathlib import Path

import pytest
import torch

from flowrl.front import compiler, registry

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "debugging"


def test_example_graph_compiles_with_a_checkpoint_every_step():
    plan = compiler.compile_file(EXAMPLE / "grpo_stats.toml")
    assert plan.spec.run.save_every == 1 and plan.spec.run.steps == 4
    assert plan.spec.nodes["update_policy"].params.stats_every == 3  # fails at step 3
    assert (plan.spec.base_dir / plan.spec.nodes["reward"].params.scorer.split(":")[0]).is_file()


def test_example_node_has_the_bug_and_the_documented_fix_removes_it():
    ref = registry.resolve("update_with_stats.py", EXAMPLE)
    rewarded_lengths = sys.modules[ref.spec.worker.__module__].rewarded_lengths
    advantages = torch.tensor([[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5]])  # (b, t): row 0 rewarded
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    with pytest.raises(IndexError):
        rewarded_lengths(advantages, mask)
    page = (ROOT / "docs" / "debugging.md").read_text()
    fixed = re.search(r"^\+    (return .*?)  #", page, re.M).group(1)
    assert fixed == "return lengths[(advantages > 0).any(-1)]"
    names = {"lengths": mask.sum(-1), "advantages": advantages}
    assert eval(fixed.removeprefix("return "), names).tolist() == [2]  # row 0's length
