"""Engines: the train engine (forward, backward, optimizer, offload) and the rollout engine."""

from flowrl.engines.rollout import RolloutEngine
from flowrl.engines.train import TrainEngine

__all__ = ["RolloutEngine", "TrainEngine"]
