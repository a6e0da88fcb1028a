"""Recovery from a lost rank: a pool's process killed, its node gone, or a call that stopped
answering. Torch-free and Ray-free: the Ray executor raises `LostWorker`, the trainer's loop
(flowrl/runtime/controller.py) asks a `Recovery` whether to go on and how.

    step s fails with LostWorker (pool, rank, where, what it was doing)
    Recovery.allow: within run.max_restarts, not the same point as the last recovery
    wait the backoff (run.restart_backoff_s, doubled each time in a row, at most 60 s)
    every pool's ranks made again (within run.restart_wait_s of waiting for Ray's room)
    the newest complete checkpoint loaded (or the run's start, before the first one):
        models, node states, prompt loader, random generators, run.staleness's queue
    metrics.jsonl and samples.jsonl cut back to that step; a `recovery` event logged
    the steps after it run again

Every pool is made again, not only the lost rank's: the survivors hold the weights of a later
step than the checkpoint (and ranks of the lost one's pool may be blocked in a collective with
it), so the whole run goes back to one consistent point. On the deterministic path the steps
run again give the values they gave the first time (docs/recovery.md).
"""

import attrs

from flowrl.errors import FlowrlError
from flowrl.runtime.node_call import NodeFailure

BACKOFF_CAP_S = 60.0


class LostWorker(NodeFailure):
    """A rank of a pool is gone or stopped answering: an infrastructure fault, not the node's
    code. `what`: "died" (its process ended), "node lost" (its machine left the cluster) or
    "no answer" (a call ran past run.call_timeout_s); `where`: its host and process."""

    def __init__(self, message: str, pool: str, rank: int, what: str, where: str = ""):
        super().__init__(message)
        self.pool, self.rank, self.what, self.where = pool, rank, what, where


class RecoveryStop(FlowrlError, RuntimeError):
    """The run lost a rank and cannot recover: restarts used up, or the same fault again."""


@attrs.define
class Recovery:
    """How many recoveries a run may make and when it must stop instead.

    Args:
        max_restarts: run.max_restarts (0: a lost rank stops the run, as before).
        backoff_s: run.restart_backoff_s, the wait before the first restart; doubled for each
            further one without a step finished between them.
    """

    max_restarts: int
    backoff_s: float
    restarts: int = 0
    in_a_row: int = 0  # recoveries since a step last finished
    last: tuple | None = None  # (step, pool, what) of the last recovery

    def allow(self, lost: LostWorker, step: int) -> float:
        """The seconds to wait before recovering from `lost` during `step`; raises
        RecoveryStop when the run must stop instead."""
        point = (step, lost.pool, lost.what)
        if self.max_restarts == 0:
            raise RecoveryStop(f"{lost} (run.max_restarts = 0: no recovery)")
        if self.restarts >= self.max_restarts:
            raise RecoveryStop(
                f"{lost}; the run recovered {self.restarts} times already (run.max_restarts = "
                f"{self.max_restarts}): raise it to recover more often"
            )
        if self.in_a_row and self.last == point:
            raise RecoveryStop(
                f"{lost}; the same fault stopped step {step} again after the last recovery, so "
                "it would recur: it is a fault of that point, not a passing one"
            )
        wait = min(self.backoff_s * 2**self.in_a_row, BACKOFF_CAP_S)
        self.restarts, self.in_a_row, self.last = self.restarts + 1, self.in_a_row + 1, point
        return wait

    def finished(self, step: int) -> None:
        """A step finished (logged and, when due, saved)."""
        if self.last is None or step >= self.last[0]:
            self.in_a_row = 0

    def event(
        self, lost: LostWorker, step: int, restored: int, source: str, seconds: float, began: float
    ):
        """The `recovery` row of metrics.jsonl (`began`: when it began, Unix time), and the
        console line."""
        row = {
            "event": "recovery",
            "step": step,
            "restart": self.restarts,
            "lost": f"pool {lost.pool}, rank {lost.rank}",
            "what": lost.what,
            "where": lost.where,
            "cause": str(lost),
            "restored_from": source,
            "restored_step": restored,
            "seconds": round(seconds, 3),
            "time": round(began, 3),
        }
        said = (
            f"step {step}: pool {lost.pool}, rank {lost.rank} {lost.what}"
            f"{f' ({lost.where})' if lost.where else ''}; every pool made again and "
            f"{source} loaded in {seconds:.1f} s; going on from step {restored} "
            f"(recovery {self.restarts} of at most {self.max_restarts})"
        )
        return row, said
