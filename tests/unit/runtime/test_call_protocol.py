"""The call protocol between the walk and a pool rank (flowrl/runtime/node_call.py): a rank keeps
each node's engine and params itself, so a call with changed params (validation's greedy
decoding) and the optional writes those params decide never read attributes of the user's
worker; every rank method answers with a record."""

import pickle
from pathlib import Path

import torch

from flowrl.front import schema
from flowrl.protocol import DataProto
from flowrl.runtime.node_call import CallResult, Timed
from flowrl.runtime.pool_worker import PoolWorker
from flowrl.runtime.setup import NodeSetup, PoolSetup
from flowrl.runtime.weights import Weights

ROOT = Path(__file__).resolve().parents[3]

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


def test_exported_weights_pickle_their_bytes_out_of_band_and_load_back_equal(tmp_path):
    worker = rank(tmp_path)
    exported = worker.export_weights("policy")
    state = exported.value
    assert isinstance(state, Weights)
    # odd tensors too: bfloat16 (which numpy lacks), a scalar, a non-contiguous view
    state = Weights({**state, "bf16": torch.randn(3, 5).bfloat16(), "scalar": torch.tensor(7)})
    state["strided"] = torch.arange(24.0).reshape(4, 6)[:, ::2]
    buffers = []
    stream = pickle.dumps(state, protocol=5, buffer_callback=buffers.append)
    size = sum(v.numel() * v.element_size() for v in state.values())
    # every tensor's bytes travel beside the stream (a buffer each), not in it
    assert len(buffers) == len(state) and sum(b.raw().nbytes for b in buffers) == size
    assert len(stream) < size / 20  # names, dtypes and shapes
    back = pickle.loads(stream, buffers=buffers)
    assert isinstance(back, Weights) and back.keys() == state.keys()
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    # loaded into a rank whose weights differ, they make its weights those exported
    other = rank(tmp_path)
    with torch.no_grad():
        for p in other.train["policy"].module.parameters():
            p.zero_()
    arrived = pickle.loads(pickle.dumps(exported, protocol=5))
    other.import_weights("policy", arrived)
    for name, tensor in other.train["policy"].module.state_dict().items():
        assert torch.equal(tensor, exported.value[name]), name
