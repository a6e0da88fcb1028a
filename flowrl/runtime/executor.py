"""Walk one step's plan: dispatch rows to pool ranks, run items when their deps are done,
collect outputs and merge them into the step's DataProto.

`Executor` holds the walk; subclasses say how a pool's ranks are reached: `LocalExecutor`
(local_executor.py) runs one in-process rank per pool, `RayExecutor` (ray_executor.py) an actor
per rank. Pool calls are submitted asynchronously, so items with no path between them overlap
on Ray. Executors are looked up by name in `flowrl.runtime.EXECUTORS`.
"""

import abc
import time

import attrs

from flowrl.nodespec import KEEP
from flowrl.protocol import DataProto
from flowrl.runtime import step_log, weights
from flowrl.runtime.inputs import Recording
from flowrl.runtime.node_call import ControllerFn, NodeCall, NodeFailure, call_node
from flowrl.runtime.trace import Slice
from flowrl.runtime.writes_check import check_writes

# 2-D columns padded on the left (the loader left-pads prompts); every other one is response-
# aligned and padded on the right
LEFT_PADDED = ("prompts", "prompt_mask")


@attrs.frozen
class StepResult:
    """What a walk of the plan gives back (`Executor.run_step`, `refilled_step`,
    `Trainer.step`): the batch with every node's writes, the metrics, and the slices the
    step's timings and trace are made of."""

    batch: DataProto
    metrics: dict
    slices: list
    seen: DataProto | None = None  # every row generated, when more than `batch` (a refill)


class Executor(abc.ABC):
    """Runs a plan's steps on the pools' ranks. A subclass says how ranks are reached:

    - `pools()`: the names of the pools that host models;
    - `ranks(pool)`: how many ranks the pool has;
    - `submit(pool, method, per_rank_args)`: start `PoolWorker.<method>(*args)` on every rank
      (rank k gets per_rank_args[k]) without waiting; returns a handle; every method the walk
      submits returns a record (flowrl/runtime/node_call.py: `CallResult`, `Timed`);
    - `finished(handles)`: of the handles given, those whose work is done, blocking until at
      least one is;
    - `results(handle)`: each rank's return value, in rank order; raises NodeFailure naming
      the pool and rank when a rank failed;
    - `shutdown()`: release the ranks (processes, placement groups);
    - where `restartable`: `release()` and `restart(wait_s)`, to make lost ranks again
      (flowrl/runtime/recovery.py).
    """

    concurrent = True  # walks from two threads run at once (run.staleness's two stages)
    restartable = False  # `release` and `restart` make lost ranks again (recovery.py)

    def __init__(self, plan):
        self.plan, self.spec = plan, plan.spec
        self._by_id = {i.id: i for i in plan.items}
        self.node_state: dict[str, dict] = {
            n: {} for n, d in self.spec.nodes.items() if d.model is None
        }
        self.controller_calls = {  # what each controller node's calls share
            n: NodeCall(n, d.spec, d.rename, d.params, "on the controller")
            for n, d in self.spec.nodes.items()
            if d.model is None
        }

    # -- what subclasses provide ----------------------------------------------------------
    @abc.abstractmethod
    def pools(self) -> list[str]: ...

    @abc.abstractmethod
    def ranks(self, pool: str) -> int: ...

    @abc.abstractmethod
    def submit(self, pool: str, method: str, per_rank_args: list[tuple]): ...

    @abc.abstractmethod
    def finished(self, handles: list) -> list: ...

    @abc.abstractmethod
    def results(self, handle) -> list: ...

    def shutdown(self) -> None:  # noqa: B027 (nothing to release by default)
        pass

    def release(self) -> None:
        """End every rank, keeping what `restart` needs (only where `restartable`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot make its ranks again")

    def restart(self, wait_s: float) -> None:
        """Make every rank again after `release`, waiting up to `wait_s` for room."""
        raise NotImplementedError(f"{type(self).__name__} cannot make its ranks again")

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

    def apply(self, pool: str, fn, *args) -> list:
        """`fn(worker, *args)` on every rank of `pool` (`PoolWorker.apply`), waited for: each
        rank's result, in rank order. For tests and diagnostics that look inside the ranks."""
        return self.results(self.submit(pool, "apply", [(fn, *args)] * self.ranks(pool)))

    # -- the walk --------------------------------------------------------------------------
    def run_step(
        self,
        batch: DataProto,
        only: set | None = None,
        param_changes: dict | None = None,
        record: Recording | None = None,
    ) -> StepResult:
        """Run the plan's items (those of nodes in `only`, if given) on `batch`.

        `param_changes` maps a node id to params to change for this walk, {node: {param:
        value}} (e.g. greedy decoding for validation).
        `record` says where a failed call's inputs go, and which nodes' inputs to keep
        (flowrl/runtime/inputs.py); None keeps nothing.
        Under `only`, the other items are passed over in plan order: a pool's transitions keep
        their order around the calls that run (a model no running call uses is not moved), so
        a partial walk leaves every pool as a whole step does.
        """
        walk = _Walk(list(self.plan.items), batch, record, skip=self._skipped(only))
        return self._walk(walk, param_changes or {})

    def run_stage(
        self,
        batch: DataProto,
        ids,
        record: Recording | None = None,
        track: str = "controller",
        param_changes: dict | None = None,
    ) -> StepResult:
        """Run the items `ids` (a stage of run.staleness's pipeline, flowrl/front/pipeline.py)
        on `batch`, passing the others over; `track`: the trace track of its controller items
        (the stages run at once, each on its own); `param_changes` as in `run_step`."""
        keep = set(ids)
        skip = {i.id for i in self.plan.items if i.id not in keep}
        walk = _Walk(list(self.plan.items), batch, record, skip=skip, track=track)
        return self._walk(walk, param_changes or {})

    def _walk(self, walk: "_Walk", param_changes: dict) -> StepResult:
        while len(walk.done) < len(walk.items):
            _after_requests(walk)
            ready = [i for i in walk.items if walk.ready(i)]
            for item in ready:
                self._start(item, walk, param_changes)
            if not ready:
                self._wait(walk)
        return StepResult(walk.batch, walk.metrics, walk.slices, walk.seen)

    def _skipped(self, only: set | None) -> set:
        """Ids of the items a walk over the nodes in `only` passes over."""
        if only is None:
            return set()
        calls = [i for i in self.plan.items if i.kind in ("call", "controller") and i.node in only]
        used = {i.model for i in calls if i.model}
        trained = {i.model for i in calls if i.mode == "train"}
        skip = set()
        for item in self.plan.items:
            if item.kind == "sync":
                wanted = item.model in trained
            elif item.node is not None:
                wanted = item.node in only
            else:  # reload / offload
                wanted = item.model in used
            if not wanted:
                skip.add(item.id)
        return skip

    def _start(self, item, walk: "_Walk", param_changes: dict) -> None:
        if item.id in walk.skip:
            walk.done.add(item.id)
            return
        start = time.time()
        if item.kind == "controller":
            if self.controller_calls[item.node].spec.rows == "filter" and walk.seen is None:
                walk.seen = walk.batch  # every row generated, before a filter drops some
            walk.batch = self._controller(item.node, walk.batch, walk.metrics, walk.record)
        elif item.kind == "dispatch":
            walk.chunks[item.node] = self._dispatch(item, walk.batch)
        elif item.kind == "call":
            chunks = walk.chunks.pop(item.node)
            changes = param_changes.get(item.node)
            args = [(item.node, c, changes, walk.record) for c in chunks]
            walk.pending[item.id] = self.submit(item.pool, "call", args)
            return
        elif item.kind == "collect":
            walk.batch = self._collect(item, walk.batch, walk.outputs.pop(item.node), walk.metrics)
        elif item.kind == "sync" and item.to_pool:
            walk.pending[item.id] = weights.send(self, item.model, item.pool, item.to_pool)
            return
        else:  # reload / offload / sync in place
            args = [(item.kind, item.model, item.parts)] * self.ranks(item.pool)
            walk.pending[item.id] = self.submit(item.pool, "transition", args)
            return
        walk.done.add(item.id)
        walk.slices.append(
            Slice(item.name, item.kind, walk.track, start, time.time(), len(walk.batch))
        )

    def _wait(self, walk: "_Walk") -> None:
        ids = {id(handle): item_id for item_id, handle in walk.pending.items()}
        for handle in self.finished(list(walk.pending.values())):
            item = self._by_id[ids[id(handle)]]
            try:
                results = self.results(handle)
            except NodeFailure:
                raise
            except Exception as e:
                raise NodeFailure(f"{item.kind} {item.name} failed on pool {item.pool}: {e}") from e
            del walk.pending[item.id]
            walk.done.add(item.id)
            if item.kind == "sync" and item.to_pool:
                walk.slices += weights.slices(item.model, item.pool, item.to_pool, results)
                continue
            for rank, result in enumerate(results):  # CallResult for a call, else Timed
                rows = len(result.writes) if item.kind == "call" else 0
                track = f"{item.pool}/rank{rank}"
                walk.slices.append(
                    Slice(item.name, item.kind, track, result.start, result.end, rows)
                )
                if item.kind == "call":  # a node's own phases, e.g. decode and tools
                    for name, p0, p1 in result.phases:
                        walk.slices.append(Slice(f"{item.name}/{name}", "phase", track, p0, p1))
            if item.kind == "call":
                walk.outputs[item.node] = results

    def sync_rollout_pools(self) -> None:
        """Send every trained model's weights to its rollout pool now (after a resume)."""
        for item in self.plan.items:
            if item.kind == "sync" and item.to_pool:
                weights.sent(self, item.model, item.pool, item.to_pool)

    def _dispatch(self, item, batch: DataProto) -> list[DataProto]:
        rows = batch.select(item.keys)
        ranks = self.ranks(item.pool)
        if item.how == "split":
            return rows.chunk(ranks)
        if item.how == "rank0":
            return [rows] + [rows.index(slice(0, 0))] * (ranks - 1)
        return [rows] * ranks  # broadcast

    def _collect(self, item, batch, results, metrics) -> DataProto:
        decl = self.spec.nodes[item.node]
        outs = [r.writes for r in results]
        # ranks that generate stop at their own longest response: pad to the widest
        writes = DataProto.concat_padded(outs, LEFT_PADDED) if item.how == "concat" else outs[0]
        _merge_metrics(metrics, item.node, [r.metrics for r in results])
        return _merge(batch, writes, decl)

    def _controller(self, node: str, batch: DataProto, metrics: dict, record=None) -> DataProto:
        call, decl = self.controller_calls[node], self.spec.nodes[node]
        state = self.node_state[node] if call.spec.stateful else None
        saver = None
        if record is not None:
            saver = record.saver(node, decl.uses, decl.params, state=state)
        context = {"base_dir": str(self.spec.base_dir)}  # relative paths in params resolve here
        run = ControllerFn(call.spec, call.params, state)
        result = call_node(call, batch.select(decl.reads), run, context, saver)
        _merge_metrics(metrics, node, [result.metrics])
        if call.spec.rows == "filter":
            return batch.index(result.writes[decl.rename.get(KEEP, KEEP)])
        return _merge(batch, result.writes, decl)


@attrs.define
class _Walk:
    """The state of one walk over a step's items."""

    items: list
    batch: DataProto
    record: Recording | None = None  # what to keep of node calls (inputs.py)
    done: set = attrs.Factory(set)
    pending: dict = attrs.Factory(dict)  # item id -> handle of work in flight on a pool
    chunks: dict = attrs.Factory(dict)  # node -> the rows dispatched to each rank
    outputs: dict = attrs.Factory(dict)  # node -> per-rank results waiting to be collected
    metrics: dict = attrs.Factory(dict)
    slices: list = attrs.Factory(list)
    skip: set = attrs.Factory(set)  # ids of items passed over (done once their deps are)
    track: str = "controller"  # the trace track of its controller items
    requests_checked: bool = False  # the step's failed requests were counted (once a walk)
    seen: DataProto | None = None  # the batch before the walk's first filter node

    def ready(self, item) -> bool:
        if item.id in self.done or item.id in self.pending:
            return False
        return all(d in self.done for d in item.deps)


def _after_requests(walk: _Walk) -> None:
    """Once a walk's multi-turn requests are done (its batch has `rollout_info`), before any
    node reads their rows:

    - When most of them failed (`step_log.failed_step`), the walk passes over its remaining
      node items, the update among them, rather than feed them rows without responses;
      transitions still run, so each pool's residency stays in order. The batch's meta says
      why (`FAILED_STEP`) for the controller. A walk that trains nothing (validation, the
      rollout stage of run.staleness) goes on: it scores what the requests gave.
    - Otherwise the requests whose infrastructure failed (termination "infra": an engine that
      died or aborted them, a tool's service down) leave the batch, with the rest of a group
      they leave too small (`step_log.infra_rows`): they are never scored, so never count as
      the model's failures in a group's statistics. `infra_failed` and
      `infra_groups_dropped` count them."""
    if walk.requests_checked or "rollout_info" not in walk.batch:
        return
    walk.requests_checked = True
    left = [i for i in walk.items if i.id not in walk.done | walk.skip | set(walk.pending)]
    if any(i.kind == "call" and i.mode == "train" for i in left):
        if failed := step_log.failed_step(walk.batch):
            walk.skip |= {i.id for i in left if i.kind not in ("reload", "offload")}
            walk.batch.meta[step_log.FAILED_STEP] = failed
            return
    rows, groups = step_log.infra_rows(walk.batch)
    walk.metrics["infra_failed"] = float(
        sum(i["termination"] == "infra" for i in walk.batch["rollout_info"])
    )
    walk.metrics["infra_groups_dropped"] = float(groups)
    if rows:
        dropped = set(rows)
        keep = [i for i in range(len(walk.batch)) if i not in dropped]
        walk.batch = walk.batch.index(keep)


def _merge(batch: DataProto, writes: DataProto, decl) -> DataProto:
    if decl.spec.rows == "repeat" and len(writes) != len(batch):
        batch = batch.repeat(len(writes) // max(len(batch), 1), interleave=True)
    if not writes.keys():
        return batch
    if len(writes) != len(batch):
        raise NodeFailure(f"node {decl.id} returned {len(writes)} rows for a batch of {len(batch)}")
    merged = batch.union(writes)
    check_writes(decl.id, decl.uses, writes, merged)
    return merged


def _merge_metrics(metrics: dict, node: str, per_rank: list[dict]) -> None:
    keys = {k for m in per_rank for k in m}
    for key in keys:
        values = [float(m[key]) for m in per_rank if key in m]
        metrics[f"{node}/{key}"] = sum(values) / len(values)
