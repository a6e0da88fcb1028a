"""Engines: the train engine (forward, backward, optimizer, offload) and the rollout backends
(the request contract in rollout.py, their table in flowrl/backends.py; flowrl's own
continuous-batching engine in hf/; an in-process SGLang engine in sglang/, imported only when
a graph picks it).

The names below load on first use (flowrl/lazy.py), so that importing a torch-free module of
this package imports no torch.
"""

from typing import TYPE_CHECKING

from flowrl.lazy import exports

if TYPE_CHECKING:  # for readers and type checkers; at run time __getattr__ imports them
    from flowrl.engines.hf.engine import HFRollout
    from flowrl.engines.rollout import RolloutBackend, make_rollout
    from flowrl.engines.train.engine import TrainEngine

__getattr__ = exports(
    __name__,
    {
        "HFRollout": "flowrl.engines.hf.engine:HFRollout",
        "RolloutBackend": "flowrl.engines.rollout:RolloutBackend",
        "make_rollout": "flowrl.engines.rollout:make_rollout",
        "TrainEngine": "flowrl.engines.train.engine:TrainEngine",
    },
)

__all__ = ["HFRollout", "RolloutBackend", "TrainEngine", "make_rollout"]
