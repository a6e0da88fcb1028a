"""One node call, the same on the controller and on a pool rank:

    rename in -> the node's fn or worker -> check the writes -> rename out

The executor calls it for controller nodes and `PoolWorker` for model nodes, so what happens
when a node runs, and how a node that returns the wrong keys fails, is written once; so is
keeping a failed call's inputs for `flowrl replay` (the `save_to` hook, flowrl/runtime/inputs.py).
"""

from collections.abc import Callable

import torch

from flowrl.errors import FlowrlError
from flowrl.nodespec import KEEP, NodeSpec, split_output
from flowrl.protocol import DataProto


class NodeFailure(FlowrlError, RuntimeError):
    """A node failed: names the node, where it ran, and the batch it was given."""


def call_node(
    node_id: str,
    spec: NodeSpec,
    rename: dict[str, str],
    batch: DataProto,
    run: Callable[[DataProto], object],
    where: str,
    meta: dict | None = None,
    save_to=None,
    params=None,
) -> tuple[DataProto, dict]:
    """Run one node on `batch` (graph keys); returns (its writes under graph keys, metrics).

    Args:
        rename: the node's declared key -> graph key.
        run: the node's code on the renamed batch: `fn(batch, params[, state])` or
            `worker(batch)`, returning writes or (writes, metrics).
        where: for messages, e.g. "on the controller" or "on pool main, rank 1".
        meta: added to the batch's meta for this call (e.g. rank, world_size).
        save_to: None, or a hook (`flowrl.runtime.inputs.Saver`) with `before(batch)`, called
            before the node runs, and `failed(batch, error) -> str`, called when it fails,
            whose text (where the inputs went, the replay command) ends the failure's message.
        params: the node's params, which decide its optional writes (None: none).

    A filter node (rows="filter") returns only `keep`; any other node exactly its declared
    writes. Anything else raises NodeFailure naming the node.
    """
    local = batch.renamed({graph_key: key for key, graph_key in rename.items()})
    local.meta.update(meta or {})
    if save_to is not None:
        save_to.before(batch)
    try:
        writes, metrics = split_output(run(local))
    except Exception as e:
        hint = save_to.failed(batch, e) if save_to is not None else ""
        raise NodeFailure(
            f"node {node_id} failed {where}: {type(e).__name__}: {e}\n"
            f"  its batch: {batch.describe()}{hint}"
        ) from e
    declared = spec.writes if params is None else spec.writes_for(params)
    expected = {KEEP} if spec.rows == "filter" else set(declared)
    if set(writes) != expected:
        missing, extra = sorted(expected - set(writes)), sorted(set(writes) - expected)
        error = NodeFailure(
            f"node {node_id} returned keys {sorted(writes)}, but declares {sorted(expected)}"
            + (f" (missing: {', '.join(missing)})" if missing else "")
            + (f" (not declared: {', '.join(extra)})" if extra else "")
            + f" {where}: return exactly the keys in its SPEC's writes"
        )
        hint = save_to.failed(batch, error) if save_to is not None else ""
        raise NodeFailure(f"{error}{hint}")
    if spec.rows == "filter":
        _check_keep(node_id, writes[KEEP], len(batch), where)
    if not writes:
        return DataProto.from_dict({}), metrics
    return DataProto.from_columns({rename.get(k, k): v for k, v in writes.items()}), metrics


def _check_keep(node_id: str, keep, rows: int, where: str) -> None:
    """A filter's `keep` is a bool mask over its rows (an int tensor would pick rows by index)."""
    if not (isinstance(keep, torch.Tensor) and keep.dtype == torch.bool and keep.shape == (rows,)):
        shape = tuple(keep.shape) if hasattr(keep, "shape") else type(keep).__name__
        kind = getattr(keep, "dtype", "")
        raise NodeFailure(
            f"filter node {node_id} returned keep {kind} {shape} {where}, but keep must be a "
            f"torch.bool tensor of shape ({rows},): True for each row to keep"
        )
