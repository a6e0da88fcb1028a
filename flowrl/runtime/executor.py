"""Walk one step's plan: dispatch rows to pool ranks, run items when their deps are done,
collect outputs and merge them into the step's DataProto.

`Executor` holds the walk; subclasses say how a pool's ranks are reached: `LocalExecutor` runs
one in-process rank per pool, `RayExecutor` (ray_executor.py) an actor per rank. Pool calls are
submitted asynchronously, so items with no path between them overlap on Ray.
"""

import time

import attrs
import torch

from flowrl import registry
from flowrl.nodespec import KEEP, split_output
from flowrl.protocol import DataProto
from flowrl.runtime.pool_worker import PoolWorker, pool_setups


class NodeFailure(RuntimeError):
    """A node failed: names the node, pool, rank and the batch it was given."""


@attrs.define
class Slice:
    """One item's run on one rank (or the controller), for timing and the trace."""

    name: str
    kind: str
    track: str  # "controller" or "<pool>/rank<k>"
    start: float
    end: float
    rows: int = 0


class Executor:
    def __init__(self, spec, plan):
        self.spec, self.plan = spec, plan
        self.controller_fns = {}
        for node, decl in spec.nodes.items():
            if decl.model is None:
                self.controller_fns[node] = registry.resolve(decl.uses, spec.base_dir).spec
        self.node_state: dict[str, dict] = {n: {} for n in self.controller_fns}

    # -- what subclasses provide ----------------------------------------------------------
    def ranks(self, pool: str) -> int:
        raise NotImplementedError

    def submit(self, pool: str, method: str, per_rank_args: list[tuple]):
        """Start `method` on every rank of `pool`; returns a handle for `finished`/`results`."""
        raise NotImplementedError

    def finished(self, handles: list) -> list:
        """Of the handles given, those whose work is done; blocks until at least one is."""
        raise NotImplementedError

    def results(self, handle) -> list:
        raise NotImplementedError

    def rank0_output(self, handle):
        """Rank 0's result of a submitted call, in a form `submit` can pass on as an argument
        (a value here; on Ray a reference, so the data goes worker to worker)."""
        return self.results(handle)[0]

    def broadcast(self, method: str, *args) -> list:
        """Call `method` on every rank of every pool and wait."""
        out = []
        for pool in self.pools():
            out += self.results(self.submit(pool, method, [args] * self.ranks(pool)))
        return out

    def pools(self) -> list[str]:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass

    # -- the walk --------------------------------------------------------------------------
    def run_step(self, batch: DataProto, only: set | None = None, overrides: dict | None = None):
        """Run the plan's items (those of nodes in `only`, if given) on `batch`.

        `overrides` maps a node id to params to change for this walk (e.g. greedy decoding).
        Returns (batch with every node's writes, metrics, slices).
        """
        walk = _Walk([i for i in self.plan.items if _wanted(i, only)], batch)
        while len(walk.done) < len(walk.items):
            ready = [i for i in walk.items if walk.ready(i)]
            for item in ready:
                self._start(item, walk, overrides or {})
            if not ready:
                self._wait(walk)
        return walk.batch, walk.metrics, walk.slices

    def _start(self, item, walk: "_Walk", overrides: dict) -> None:
        start = time.time()
        if item.kind == "controller":
            walk.batch = self._controller(item.node, walk.batch, walk.metrics)
        elif item.kind == "dispatch":
            walk.chunks[item.node] = self._dispatch(item, walk.batch)
        elif item.kind == "call":
            args = [(item.node, c, overrides.get(item.node)) for c in walk.chunks.pop(item.node)]
            walk.pending[item.id] = self.submit(item.pool, "call", args)
            return
        elif item.kind == "collect":
            walk.batch = self._collect(item, walk.batch, walk.outputs.pop(item.node), walk.metrics)
        elif item.kind == "sync" and item.to_pool:
            walk.pending[item.id] = self._send_weights(item)
            return
        else:  # reload / offload / sync in place
            args = [(item.kind, item.model, item.parts)] * self.ranks(item.pool)
            walk.pending[item.id] = self.submit(item.pool, "transition", args)
            return
        walk.done.add(item.id)
        walk.slices.append(
            Slice(item.name, item.kind, "controller", start, time.time(), len(walk.batch))
        )

    def _wait(self, walk: "_Walk") -> None:
        ids = {id(handle): item_id for item_id, handle in walk.pending.items()}
        for handle in self.finished(list(walk.pending.values())):
            item = walk.by_id[ids[id(handle)]]
            try:
                results = self.results(handle)
            except NodeFailure:
                raise
            except Exception as e:
                raise NodeFailure(f"{item.kind} {item.name} failed on pool {item.pool}: {e}") from e
            del walk.pending[item.id]
            walk.done.add(item.id)
            for rank, result in enumerate(results):
                t0, t1 = result[-1]
                rows = len(result[0]) if item.kind == "call" else 0
                track = f"{item.to_pool or item.pool}/rank{rank}"
                walk.slices.append(Slice(item.name, item.kind, track, t0, t1, rows))
            if item.kind == "call":
                walk.outputs[item.node] = results

    def _send_weights(self, item):
        """A sync to another pool: rank 0 of the train pool exports the model's weights, every
        rank of the rollout pool loads them. Returns the handle of the loading."""
        exported = self.submit(item.pool, "export_weights", [(item.model,)] * self.ranks(item.pool))
        weights = self.rank0_output(exported)
        args = [(item.model, weights)] * self.ranks(item.to_pool)
        return self.submit(item.to_pool, "import_weights", args)

    def sync_rollout_pools(self) -> None:
        """Send every trained model's weights to its rollout pool now (after a resume)."""
        for item in self.plan.items:
            if item.kind == "sync" and item.to_pool:
                self.results(self._send_weights(item))

    def _dispatch(self, item, batch: DataProto) -> list[DataProto]:
        rows = batch.select(item.keys)
        ranks = self.ranks(item.pool)
        if item.how.startswith("split"):
            return rows.chunk(ranks)
        if item.how.startswith("rank0"):
            return [rows] + [rows.index(slice(0, 0))] * (ranks - 1)
        return [rows] * ranks

    def _collect(self, item, batch, results, metrics) -> DataProto:
        decl = self.spec.nodes[item.node]
        outs = [r[0] for r in results]
        writes = DataProto.concat(outs) if item.how == "concat" else outs[0]
        _merge_metrics(metrics, item.node, [r[1] for r in results])
        return _merge(batch, writes, decl)

    def _controller(self, node: str, batch: DataProto, metrics: dict) -> DataProto:
        decl, spec = self.spec.nodes[node], self.controller_fns[node]
        inverse = {new: old for old, new in decl.rename.items()}
        view = _renamed(batch.select(decl.reads), inverse)
        try:
            args = (
                (view, decl.params, self.node_state[node]) if spec.stateful else (view, decl.params)
            )
            writes, node_metrics = split_output(spec.fn(*args))
        except Exception as e:
            raise NodeFailure(
                f"node {node} ({decl.uses}) failed on the controller: "
                f"{type(e).__name__}: {e}\n  its batch: {describe(view)}"
            ) from e
        _merge_metrics(metrics, node, [node_metrics])
        if spec.rows == "filter":
            return batch.index(writes[KEEP])
        renamed = {decl.rename.get(k, k): v for k, v in writes.items()}
        tensors = {k: v for k, v in renamed.items() if isinstance(v, torch.Tensor)}
        other = {k: v for k, v in renamed.items() if not isinstance(v, torch.Tensor)}
        return _merge(batch, DataProto.from_dict(tensors, other), decl)


class LocalExecutor(Executor):
    """Every pool as one in-process rank: the same worker code, easy to debug."""

    def __init__(self, spec, plan):
        super().__init__(spec, plan)
        setups = pool_setups(spec, plan)
        self.workers = {name: [PoolWorker(setup)] for name, setup in setups.items()}

    def pools(self):
        return list(self.workers)

    def ranks(self, pool):
        return 1

    def submit(self, pool, method, per_rank_args):
        worker = self.workers[pool][0]
        try:
            return [getattr(worker, method)(*per_rank_args[0])]
        except Exception as e:  # the worker's message names the node and its batch
            raise NodeFailure(
                f"{method} {per_rank_args[0][0]} failed on pool {pool}, rank 0: {e}"
            ) from e

    def finished(self, handles):
        return handles

    def results(self, handle):
        return handle


@attrs.define
class _Walk:
    """The state of one walk over a step's items."""

    items: list
    batch: DataProto
    done: set = attrs.Factory(set)
    pending: dict = attrs.Factory(dict)  # item id -> handle of work in flight on a pool
    chunks: dict = attrs.Factory(dict)  # node -> the rows dispatched to each rank
    outputs: dict = attrs.Factory(dict)  # node -> per-rank results waiting to be collected
    metrics: dict = attrs.Factory(dict)
    slices: list = attrs.Factory(list)
    by_id: dict = attrs.field(init=False)

    def __attrs_post_init__(self):
        self.by_id = {i.id: i for i in self.items}

    def ready(self, item) -> bool:
        if item.id in self.done or item.id in self.pending:
            return False
        return all(d in self.done or d not in self.by_id for d in item.deps)


def _wanted(item, only) -> bool:
    if only is None:
        return True
    if item.kind == "sync":
        return False
    return item.node in only if item.node else True


def _renamed(batch: DataProto, mapping: dict) -> DataProto:
    tensors = {mapping.get(k, k): batch[k] for k in batch.keys() if k not in batch.non_tensor}
    other = {mapping.get(k, k): batch[k] for k in batch.non_tensor}
    return DataProto.from_dict(tensors, other, dict(batch.meta))


def _merge(batch: DataProto, writes: DataProto, decl) -> DataProto:
    if decl.spec.rows == "repeat" and len(writes) != len(batch):
        batch = batch.repeat(len(writes) // max(len(batch), 1), interleave=True)
    if not writes.keys():
        return batch
    if len(writes) != len(batch):
        raise NodeFailure(f"node {decl.id} returned {len(writes)} rows for a batch of {len(batch)}")
    return batch.union(writes)


def _merge_metrics(metrics: dict, node: str, per_rank: list[dict]) -> None:
    keys = {k for m in per_rank for k in m}
    for key in keys:
        values = [float(m[key]) for m in per_rank if key in m]
        metrics[f"{node}/{key}"] = sum(values) / len(values)


def describe(batch: DataProto | None) -> str:
    if batch is None:
        return "-"
    parts = []
    for key in batch.keys():
        value = batch[key]
        shape = tuple(value.shape) if hasattr(value, "shape") else len(value)
        dtype = str(getattr(value, "dtype", "object")).replace("torch.", "")
        parts.append(f"{key} {shape} {dtype}")
    return f"{len(batch)} rows: " + ", ".join(parts)
