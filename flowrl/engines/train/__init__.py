"""The train engine: a module with its optimizer and scheduler, its forward passes (forward.py),
the one epoch x mini-batch x micro-batch update loop (update_loop.py), data-parallel sharding
(sharding.py: ddp, fsdp), sharded checkpoints (page-locked offload buffers: engines/host_copies.py)
and sequence scores for reward models (sequence_scores.py)."""

from flowrl.engines.train.engine import TrainEngine

__all__ = ["TrainEngine"]
