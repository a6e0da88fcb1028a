"""Engines: the train engine (forward, backward, optimizer, offload) and the rollout backends
(the contract and their table in rollout.py; flowrl's own decode loop in hf_rollout.py; an
in-process SGLang engine in sglang_backend.py, imported only when a graph picks it).

The names below load on first use, so that importing the torch-free contract
`flowrl.engines.rollout` (schema.py does, to validate `rollout = "..."`) imports no torch.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for readers and type checkers; at run time __getattr__ imports them
    from flowrl.engines.hf_rollout import HFRollout
    from flowrl.engines.hf_rollout import HFRollout as RolloutEngine
    from flowrl.engines.rollout import ROLLOUT_BACKENDS, RolloutBackend, make_rollout
    from flowrl.engines.train import TrainEngine

# public name -> (module, attribute)
_NAMES = {
    "HFRollout": ("flowrl.engines.hf_rollout", "HFRollout"),
    "RolloutEngine": ("flowrl.engines.hf_rollout", "HFRollout"),  # the former name of HFRollout
    "ROLLOUT_BACKENDS": ("flowrl.engines.rollout", "ROLLOUT_BACKENDS"),
    "RolloutBackend": ("flowrl.engines.rollout", "RolloutBackend"),
    "make_rollout": ("flowrl.engines.rollout", "make_rollout"),
    "TrainEngine": ("flowrl.engines.train", "TrainEngine"),
}


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _NAMES[name]
    return getattr(importlib.import_module(module), attr)


__all__ = [
    "HFRollout",
    "ROLLOUT_BACKENDS",
    "RolloutBackend",
    "RolloutEngine",
    "TrainEngine",
    "make_rollout",
]
