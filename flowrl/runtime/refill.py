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

# 2-D columns padded on the left (the loader left-pads prompts); every other one is response-
# aligned and padded on the right
LEFT_PADDED = ("prompts", "prompt_mask")


def refilled_step(
    executor, refill, first: DataProto, more: Callable[[int], DataProto], record=None
):
    """One training step under `refill` (a `flowrl.front.plan.RefillPlan`).

    Args:
        executor: runs partial walks of the plan.
        first: the step's first prompt batch.
        more: round k -> the k-th further prompt batch (k = 1, 2, ...).
        record: what the walks keep of their node calls (`Executor.run_step`); a node kept
            by run.save_inputs keeps its last round's inputs.

    Returns:
        (the trained batch, metrics, slices), as `Executor.run_step`. When nothing is kept,
        the nodes after the filter do not run (no update this step).
    """
    parts, metrics, slices = [], [], []
    batch = first
    for round_ in range(1, refill.rounds + 1):
        out, round_metrics, round_slices = executor.run_step(
            batch, only=set(refill.before), record=record
        )
        parts.append(out)
        metrics.append(round_metrics)
        slices += round_slices
        if not refill.groups or group_count(parts) >= refill.groups or round_ == refill.rounds:
            break
        batch = more(round_)
    kept = concat_padded(parts)
    found = group_count([kept])
    if refill.groups:
        kept = first_groups(kept, refill.groups)
    summary = {"refill/rounds": len(parts), "refill/groups": found, "refill/rows": len(kept)}
    step_metrics = {**ops.mean_metrics(metrics), **summary}
    if len(kept) == 0:
        return kept, step_metrics, slices
    out, after_metrics, after_slices = executor.run_step(
        kept, only=set(refill.after), record=record
    )
    return out, {**step_metrics, **after_metrics}, slices + after_slices


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


def concat_padded(parts: list[DataProto]) -> DataProto:
    """Concatenate batches whose 2-D columns may differ in width (each round pads its prompts
    and responses to its own longest): zeros on the left of `LEFT_PADDED` columns, on the right
    of the others; masks are 0 there, so no forward or loss sees the padding."""
    parts = [p for p in parts if len(p)] or parts[:1]
    if len(parts) == 1:
        return parts[0]
    padded = []
    for part in parts:
        columns = {key: part[key] for key in part.keys()}
        for key, value in columns.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                width = max(p[key].shape[1] for p in parts)
                extra = width - value.shape[1]
                side = (extra, 0) if key in LEFT_PADDED else (0, extra)
                columns[key] = torch.nn.functional.pad(value, (0, 0) * (value.dim() - 2) + side)
        padded.append(DataProto.from_columns(columns, part.meta))
    return DataProto.concat(padded)
