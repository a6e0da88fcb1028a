"""A state a checkpoint keeps that JSON cannot hold stops with the owner named and the fix
(not a disk-write error telling to free space): a controller node's, a model node worker's."""

from types import SimpleNamespace

import pytest

from flowrl.errors import StateError


def test_a_nodes_state_json_cannot_hold_names_the_node():
    from flowrl.runtime.restoring import _state_json

    state = {"step": 2, "loader": {}, "node_state": {"bonus": {"seen": {1, 2}}}, "rng": {}}
    with pytest.raises(StateError) as caught:
        _state_json(state)
    message = str(caught.value)
    assert "node bonus keeps state['seen'] = {1, 2} (a set)" in message
    assert "a list for a set" in message and "free space" not in message


def test_a_workers_state_json_cannot_hold_names_the_node():
    import torch

    from flowrl.runtime.pool_worker import PoolWorker

    class Worker:
        def state_dict(self):
            return {"loss": {"beta": torch.tensor(1.0)}}

    ranks = SimpleNamespace(nodes={"update_policy": SimpleNamespace(worker=Worker())})
    with pytest.raises(StateError, match=r"node update_policy: its worker's state_dict\(\)"):
        PoolWorker.node_states(ranks)
