"""The call protocol between the walk and a pool rank (flowrl/runtime/node_call.py): a rank keeps
each node's engine and params itself, so a call with changed params (validation's greedy
decoding) and the optional writes those params decide never read attributes of the user's
worker; every rank method answers with a record."""

from pathlib import Path

import torch

from flowrl.front import schema
from flowrl.protocol import DataProto
from flowrl.runtime.node_call import CallResult, Timed
from flowrl.runtime.pool_worker import PoolWorker
from flowrl.runtime.setup import NodeSetup, PoolSetup

ROOT = Path(__file__).resolve().parents[2]

# a worker that keeps its engine and params under names of its own
NODE = """
import attrs
import torch

from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    scale: float = 1.0
    extra: bool = False


class Scaler:
    def __init__(self, engine, params):
        self._e, self._p = engine, params

    def __call__(self, batch):
        rows = len(batch)
        out = {"scaled": batch["scores"] * self._p.scale}
        if self._p.extra:
            out["extra"] = torch.full((rows,), float(self._e.device == "cpu"))
        return out, {"rows": float(rows)}, [("inner", 1.0, 2.0)]


SPEC = NodeSpec(
    reads=("scores",),
    writes=("scaled",),
    params=Params,
    worker=Scaler,
    mode="inference",
    optional_writes={"extra": lambda p: p.extra},
)
"""


def rank(tmp_path) -> PoolWorker:
    (tmp_path / "scaler.py").write_text(NODE)
    node = NodeSetup("scale", "scaler.py", {"scale": 2.0}, "policy", {"scaled": "my_scaled"})
    models = {"policy": schema.ModelConfig(path="tiny")}
    return PoolWorker(PoolSetup("main", "cpu", 1, 0, str(tmp_path), models, {}, (), (node,)))


def test_a_call_with_changed_params_rebuilds_the_worker_from_what_the_rank_kept(tmp_path):
    worker = rank(tmp_path)
    batch = DataProto.from_dict({"scores": torch.tensor([1.0, 3.0])})
    plain = worker.call("scale", batch)
    assert isinstance(plain, CallResult) and plain.writes.keys() == ["my_scaled"]
    torch.testing.assert_close(plain.writes["my_scaled"], torch.tensor([2.0, 6.0]))
    assert plain.metrics == {"rows": 2.0} and plain.start <= plain.end
    # the node's phases come back beside the metrics, not inside them
    assert plain.phases == (("inner", 1.0, 2.0),)
    changed = worker.call("scale", batch, {"scale": 0.5, "extra": True})
    torch.testing.assert_close(changed.writes["my_scaled"], torch.tensor([0.5, 1.5]))
    # the changed params decide the optional write: declared, so the call accepts it
    assert sorted(changed.writes.keys()) == ["extra", "my_scaled"]
    again = worker.call("scale", batch)  # the change held for that call only
    torch.testing.assert_close(again.writes["my_scaled"], torch.tensor([2.0, 6.0]))


def test_transitions_answer_with_their_wall_time(tmp_path):
    worker = rank(tmp_path)
    moved = worker.transition("offload", "policy", ("weights",))
    assert isinstance(moved, Timed) and moved.value is None and moved.start <= moved.end
