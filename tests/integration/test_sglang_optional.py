"""Nothing imports sglang unless a graph picks it: a CPU training step runs with the module
blocked (any `import sglang` fails), and the backend's module is never loaded."""

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_overrides

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

ROOT = Path(__file__).resolve().parents[2]

STEP = """
import sys
sys.modules["sglang"] = None  # any `import sglang` now fails
from flowrl.cli import load_plan
from flowrl.runtime.controller import Trainer

graph, run_dir, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
plan = load_plan(graph, overrides)
trainer = Trainer(plan, __import__("pathlib").Path(run_dir), "local")
try:
    result = trainer.step(1)
    metrics, batch = result.metrics, result.batch
finally:
    trainer.close()
assert batch["responses"].shape[0] == 2 * plan.spec.nodes["generate"].params.n
loaded = [m for m in sys.modules if sys.modules[m] is not None]
assert not [m for m in loaded if "sglang" in m], sorted(m for m in loaded if "sglang" in m)
print("step ok")
"""


def test_a_cpu_training_step_runs_with_sglang_unimportable(tmp_path):
    overrides = tiny_overrides("grpo.toml", tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", STEP, str(ROOT / "graphs/grpo.toml"), str(tmp_path / "run")]
        + overrides,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step ok" in result.stdout
