"""A controller node that forgets a declared output fails with its name, on both executors
(both run every node through flowrl/runtime/node_call.py)."""

from pathlib import Path

import pytest

from flowrl.runtime.controller import Trainer
from flowrl.runtime.node_call import NodeFailure

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

FORGETFUL = Path(__file__).resolve().parents[1] / "support" / "toy" / "forgetful_advantage.py"


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_controller_node_missing_an_output_is_named(tiny_plan, tmp_path, backend):
    plan = tiny_plan("grpo.toml", **{"nodes.advantage.uses": f'"{FORGETFUL}"'})
    trainer = Trainer(plan, tmp_path / "run", backend)
    try:
        with pytest.raises(NodeFailure) as info:
            trainer.step(1)
    finally:
        trainer.close()
    message = str(info.value)
    assert "node advantage returned keys ['advantages']" in message
    assert "missing: bonus" in message and "on the controller" in message
