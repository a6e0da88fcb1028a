"""One node call, the same on the controller and on a pool rank:

    rename in -> the node's fn or worker -> check the writes -> rename out

The executor calls it for controller nodes and `PoolWorker` for model nodes, so what happens
when a node runs, and how a node that returns the wrong keys fails, is written once; so is
keeping a failed call's inputs for `flowrl replay` (the `save_to` hook, flowrl/runtime/inputs.py).

The records here are the protocol between the walk (flowrl/runtime/executor.py) and the ranks
(flowrl/runtime/pool_worker.py): a `NodeCall` says which node runs and how, built once per node;
a rank answers a node call with a `CallResult` and a transition or weight move with a `Timed`.
"""

import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from flowrl.errors import FlowrlError, unstorable
from flowrl.nodespec import KEEP, NodeSpec, split_output
from flowrl.protocol import DataProto


class NodeFailure(FlowrlError, RuntimeError):
    """A node failed: names the node, where it ran, and the batch it was given."""


@attrs.frozen
class NodeCall:
    """What one node's calls share, built once per node (per rank on a pool)."""

    id: str  # the node's id in the graph
    spec: NodeSpec
    rename: dict[str, str]  # the node's declared key -> graph key
    params: Any  # the node's params (attrs instance): they decide its optional writes
    where: str  # for messages, e.g. "on the controller" or "on pool main, rank 1"

    def expected_writes(self) -> set[str]:
        """The keys the node must return (declared key names)."""
        if self.spec.rows == "filter":
            return {KEEP}
        return set(self.spec.writes_for(self.params))


@attrs.frozen(eq=False)
class ControllerFn:
    """A controller node's code as a call's `run`: `fn(batch, params)`, or with
    `stateful=True` `fn(batch, params, state)` on the state the executor keeps for the node."""

    spec: NodeSpec
    params: Any
    state: dict | None = None  # the node's state, when it is stateful

    def __call__(self, batch: DataProto):
        if not self.spec.stateful:
            return self.spec.fn(batch, self.params)
        out = self.spec.fn(batch, self.params, self.state)
        if problem := unstorable(self.state):  # found at the call, not at the next checkpoint
            raise TypeError(
                f"its state holds {problem}, which a checkpoint (JSON) cannot store: keep "
                "numbers, strings, lists and dicts with string keys (a list for a set or a "
                "tuple, float(x) or x.tolist() for a tensor)"
            )
        return out


@attrs.frozen
class CallResult:
    """What one node call returns to the walk.

    `phases` are the node's own wall-clock spans, (name, start, end) in epoch seconds (e.g. the
    agent node's decode and tool time); the trace shows them under the call."""

    writes: DataProto  # graph keys; empty for a node that writes nothing
    metrics: dict[str, float]
    start: float  # epoch seconds
    end: float
    phases: tuple[tuple[str, float, float], ...] = ()


@attrs.frozen
class Timed:
    """A rank's answer to a transition or a weight export/import: its value (the exported
    weights, or None) and when the work ran (epoch seconds), for the step's timings."""

    value: Any
    start: float
    end: float


def call_node(
    call: NodeCall,
    batch: DataProto,
    run: Callable[[DataProto], object],
    meta: dict | None = None,
    save_to=None,
) -> CallResult:
    """Run one node on `batch` (graph keys).

    Args:
        call: the node, its renames, params and where it runs.
        run: the node's code on the renamed batch: `fn(batch, params[, state])` or
            `worker(batch)`, returning writes, (writes, metrics) or (writes, metrics, phases).
        meta: added to the batch's meta for this call (e.g. rank, world_size).
        save_to: None, or a hook (`flowrl.runtime.inputs.Saver`) with `before(batch)`, called
            before the node runs, and `failed(batch, error) -> str`, called when it fails,
            whose text (where the inputs went, the replay command) ends the failure's message.

    Returns:
        CallResult: the writes under graph keys, metrics, phases and the call's wall time.

    A filter node (rows="filter") returns only `keep`; any other node exactly its declared
    writes. Anything else raises NodeFailure naming the node.
    """
    start = time.time()
    local = batch.renamed({graph_key: key for key, graph_key in call.rename.items()})
    local.meta.update(meta or {})
    if save_to is not None:
        save_to.before(batch)
    try:
        writes, metrics, phases = split_output(run(local))
    except Exception as e:
        hint = save_to.failed(batch, e) if save_to is not None else ""
        raise NodeFailure(
            f"node {call.id} failed {call.where}: {type(e).__name__}: {e}\n"
            f"  its batch: {batch.describe()}{hint}"
        ) from e
    expected = call.expected_writes()
    if set(writes) != expected:
        missing, extra = sorted(expected - set(writes)), sorted(set(writes) - expected)
        error = NodeFailure(
            f"node {call.id} returned keys {sorted(writes)}, but declares {sorted(expected)}"
            + (f" (missing: {', '.join(missing)})" if missing else "")
            + (f" (not declared: {', '.join(extra)})" if extra else "")
            + f" {call.where}: return exactly the keys in its SPEC's writes"
        )
        hint = save_to.failed(batch, error) if save_to is not None else ""
        raise NodeFailure(f"{error}{hint}")
    if call.spec.rows == "filter":
        _check_keep(call, writes[KEEP], len(batch))
    renamed = {call.rename.get(k, k): v for k, v in writes.items()}
    out = DataProto.from_columns(renamed) if writes else DataProto.from_dict({})
    return CallResult(out, metrics, start, time.time(), tuple(phases))


def _check_keep(call: NodeCall, keep, rows: int) -> None:
    """A filter's `keep` is a bool mask over its rows (an int tensor would pick rows by index)."""
    if not (isinstance(keep, torch.Tensor) and keep.dtype == torch.bool and keep.shape == (rows,)):
        shape = tuple(keep.shape) if hasattr(keep, "shape") else type(keep).__name__
        kind = getattr(keep, "dtype", "")
        raise NodeFailure(
            f"filter node {call.id} returned keep {kind} {shape} {call.where}, but keep must be a "
            f"torch.bool tensor of shape ({rows},): True for each row to keep"
        )
