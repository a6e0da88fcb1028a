"""A step that refills through a filter node (DAPO's dynamic sampling, arXiv 2503.14476; verl's
`filter_groups` with `max_num_gen_batches`):

    kept = []
    for round in range(rounds):                       # at most `rounds` prompt batches
        kept += walk(plan.before, next prompt batch)  # generate ... filter: informative groups
        if groups(kept) >= target: break
    batch = first `target` groups of kept
    walk(plan.after, batch)                           # advantages, updates: once, on those rows

Both walks are partial walks of the step's plan (`Executor.run_step(only=...)`), so they run
on either executor. Rounds sample different responses: the generate node's generator is
seeded by (seed, step, round, rank).
"""

from collections.abc import Callable

import torch

from flowrl.math import ops
from flowrl.protocol import DataProto
from flowrl.runtime.executor import LEFT_PADDED, StepResult


def refilled_step(
    executor, refill, first: DataProto, more: Callable[[int], DataProto], record=None
) -> StepResult:
    """One training step under `refill` (a `flowrl.front.plan.RefillPlan`).

    Args:
        executor: runs partial walks of the plan.
        first: the step's first prompt batch.
        more: round k -> the k-th further prompt batch (k = 1, 2, ...).
        record: what the walks keep of their node calls (`Executor.run_step`); a node kept
            by run.save_inputs keeps its last round's inputs.

    Returns:
        StepResult: the trained batch, metrics and slices, as `Executor.run_step`. When
        nothing is kept, the nodes after the filter do not run (no update this step).
    """
    parts, metrics, slices, seen = [], [], [], []
    batch = first
    for round_ in range(1, refill.rounds + 1):
        walked = executor.run_step(batch, only=set(refill.before), record=record)
        parts.append(walked.batch)
        seen.append(walked.seen if walked.seen is not None else walked.batch)
        metrics.append(walked.metrics)
        slices += walked.slices
        if not refill.groups or group_count(parts) >= refill.groups or round_ == refill.rounds:
            break
        batch = more(round_)
    kept = DataProto.concat_padded(parts, LEFT_PADDED)  # each round pads to its own longest
    found = group_count([kept])
    if refill.groups:
        kept = first_groups(kept, refill.groups)
    summary = {"refill/rounds": len(parts), "refill/groups": found, "refill/rows": len(kept)}
    step_metrics = {**ops.mean_metrics(metrics), **summary}
    seen = DataProto.concat_padded(seen, LEFT_PADDED)  # the filter's dropped groups too
    if len(kept) == 0:
        return StepResult(kept, step_metrics, slices, seen)
    after = executor.run_step(kept, only=set(refill.after), record=record)
    metrics = {**step_metrics, **after.metrics}
    return StepResult(after.batch, metrics, slices + after.slices, seen)


def group_count(parts: list[DataProto]) -> int:
    """Distinct `uid`s over the parts."""
    uids = [p["uid"] for p in parts if len(p)]
    return len(torch.unique(torch.cat(uids))) if uids else 0


def first_groups(batch: DataProto, groups: int) -> DataProto:
    """The rows of the first `groups` distinct uids, in order of first appearance."""
    chosen: dict[int, None] = {}
    for uid in batch["uid"].tolist():
        if len(chosen) == groups:
            break
        chosen.setdefault(uid, None)
    keep = torch.tensor([uid in chosen for uid in batch["uid"].tolist()], dtype=torch.bool)
    return batch.index(keep)
