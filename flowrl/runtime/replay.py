"""`flowrl replay RUN_DIR --step N --node ID [--rank R]`: one node call of a run, run again in
this process on the inputs it had, so a debugger, `breakpoint()` or prints see it.

    inputs       RUN_DIR/failures/ or inputs/step_<N>_<node>_rank<r>/   (flowrl/runtime/inputs.py)
    graph        RUN_DIR/graph.toml, compiled, relative paths resolved as in the run (run.json)
    model state  the node's pool built in-process as the local executor does, then the
                 checkpoint of the step whose weights the call saw (a training step N saw
                 step N-1's), or the nearest earlier one, with a note that it is not exact
    the call     flowrl.runtime.node_call.call_node, as on every executor

A rank of a multi-rank pool is replayed alone (world size 1): the sums over ranks in an update
(token counts, gradients, metrics) then cover only that rank's rows.
"""

import json
import sys
from pathlib import Path

import attrs
import torch

from flowrl.protocol import DataProto
from flowrl.runtime import checkpoint, inputs
from flowrl.runtime.node_call import CallResult, ControllerFn, NodeCall, call_node


@attrs.define
class ReplayCall:
    """One saved node call, loaded and ready: `run()` -> its CallResult (writes under graph
    keys, metrics)."""

    node: str
    decl: object  # the dsl.NodeDecl the graph has for the node
    params: object  # the node's params for this replay (the saved ones, plus any overrides)
    batch: DataProto  # what the node received on its rank, graph keys
    call: object  # the node's code on a renamed batch: a worker, or fn with params [and state]
    meta: dict | None  # what the pool rank adds to the batch's meta (rank, world size)
    info: dict  # call.json
    notes: list[str]  # what differs from the run, for the user

    def run(self) -> CallResult:
        where = f"in replay (step {self.info['step']}, rank {self.info['rank']})"
        call = NodeCall(self.node, self.decl.spec, self.decl.rename, self.params, where)
        return call_node(call, self.batch, self.call, self.meta)


def load_plan(run_dir, overrides=()):
    """The plan of a run directory's graph.toml (overrides applied), with relative paths
    resolving from the original graph file's folder, recorded in run.json."""
    from flowrl.front.compiler import compile_file

    run_dir = Path(run_dir)
    graph = run_dir / "graph.toml"
    if not graph.is_file():
        raise FileNotFoundError(f"{run_dir} has no graph.toml: is it a run directory?")
    source = run_dir / "run.json"
    base_dir = json.loads(source.read_text())["base_dir"] if source.is_file() else ""
    return compile_file(graph, overrides, base_dir)


def load(run_dir, step: int, node: str, rank: int = 0, overrides=()) -> ReplayCall:
    """Load the saved call of `node` at `step` on `rank` and what it needs to run again."""
    plan = load_plan(run_dir, overrides)
    saved = inputs.find(run_dir, step, node, rank)
    info = json.loads((saved / "call.json").read_text())
    if node not in plan.spec.nodes:
        raise LookupError(f"the graph of {run_dir} has no node {node}")
    decl = plan.spec.nodes[node]
    params = _params(decl, info["params"], overrides)
    batch = DataProto.load(saved / "batch.pt")
    notes = [f"inputs: {saved}"]
    if info.get("validation"):
        notes.append("a validation call: its params are the greedy ones validation used")
    if decl.model is None:
        state = None
        if decl.spec.stateful:
            state = _controller_state(saved, run_dir, node, info["state_step"], notes)
        call = ControllerFn(decl.spec, params, state)
        context = {"base_dir": str(plan.spec.base_dir)}  # as the executor gives controller nodes
        return ReplayCall(node, decl, params, batch, call, context, info, notes)
    engine = _engine(plan, decl, run_dir, info["state_step"], notes)
    if info["world_size"] > 1:
        notes.append(
            f"the run had {info['world_size']} ranks on this pool; rank {rank} runs here alone "
            "(world size 1), so sums over ranks (an update's token counts, gradients and "
            "metrics) cover only its rows"
        )
    meta = {"rank": rank, "world_size": 1}
    return ReplayCall(
        node, decl, params, batch, decl.spec.worker(engine, params), meta, info, notes
    )


def _params(decl, saved: dict, overrides):
    """The saved params, except those the command line sets for this node (`nodes.<id>.<k>=`),
    which come from the compiled graph; fields the node no longer has are dropped."""
    prefix = f"nodes.{decl.id}."
    changed = {o.split("=", 1)[0][len(prefix) :] for o in overrides if o.startswith(prefix)}
    fields = attrs.fields_dict(decl.spec.params)
    kwargs = {k: v for k, v in saved.items() if k in fields and k not in changed}
    kwargs |= {k: getattr(decl.params, k) for k in changed if k in fields}
    return decl.spec.params(**kwargs)


def _controller_state(saved: Path, run_dir, node: str, state_step: int, notes) -> dict:
    """A stateful controller node's state: saved with the call, else from the checkpoint."""
    if (saved / "state.pt").is_file():
        notes.append("node state: as saved with the call")
        return torch.load(saved / "state.pt", weights_only=True)
    found = _checkpoint(run_dir, state_step, notes)
    if found is None:
        return {}
    state = json.loads((found / "controller.json").read_text())
    return state["node_state"].get(node, {})


def _engine(plan, decl, run_dir, state_step: int, notes):
    """The node's engine, on its pool built in-process, with the models' state at state_step."""
    from flowrl.runtime.pool_worker import PoolWorker
    from flowrl.runtime.setup import pool_setups

    pool = plan.pool_of(decl.id)
    worker = PoolWorker(pool_setups(plan)[pool])
    found = _checkpoint(run_dir, state_step, notes)
    if found is not None:
        states = {}  # a model's state is in its own pool's file (a rollout pool holds a copy)
        for path in sorted(found.glob("pool-*.pt")):
            states |= torch.load(path, map_location="cpu", weights_only=True)
        worker.load_state_dict({m: s for m, s in states.items() if m in worker.train})
        for model in worker.rollout:
            worker.transition("sync", model, ())
    return (worker.rollout if decl.mode == "rollout" else worker.train)[decl.model]


def _checkpoint(run_dir, state_step: int, notes) -> Path | None:
    """The checkpoint after `state_step` (0: none, the initial weights), or the nearest
    earlier one; notes what is not exact."""
    if state_step == 0:
        notes.append("model state: the initial weights (as the run had them)")
        return None
    kept = [p for p in checkpoint.checkpoints(run_dir) if checkpoint.step_of(p) <= state_step]
    if not kept:
        notes.append(
            f"model state: the initial weights; the run kept no checkpoint at or before step "
            f"{state_step}, whose weights the call saw: outputs may differ from the run's "
            "(run.save_every = 1 and a larger run.keep_checkpoints keep them)"
        )
        return None
    found = kept[-1]
    exact = checkpoint.step_of(found) == state_step
    notes.append(
        f"model state: {found.name}"
        + ("" if exact else f", not step {state_step} whose weights the call saw (not exact)")
    )
    return found


def describe(writes: DataProto, metrics: dict, values: int = 4) -> str:
    """The outputs (keys, shapes, the first few values) and metrics, as text."""
    lines = ["outputs:" if writes.keys() else "outputs: none (the node writes no keys)"]
    for key in writes.keys():
        value = writes[key]
        if isinstance(value, torch.Tensor):
            count = value.numel()
            head = ", ".join(f"{float(v):.4g}" for v in value.flatten()[:values].tolist())
            shape = f"{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
        else:
            count = len(value)
            head, shape = ", ".join(repr(v) for v in value[:values]), f"({count},)"
        lines.append(f"  {key}: {shape}  [{head}{', ...' if count > values else ''}]")
    lines.append("metrics:" if metrics else "metrics: none")
    lines += [f"  {key}: {float(metrics[key]):.6g}" for key in sorted(metrics)]
    return "\n".join(lines)


def innermost(error: BaseException) -> BaseException:
    """The exception at the bottom of `error`'s chain of causes (the node's own error)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def in_this_process(error: BaseException) -> bool:
    """Whether `error` was raised in this process (not in a Ray worker), so its frames exist
    here for a post-mortem debugger."""
    ray_exceptions = sys.modules.get("ray.exceptions")
    chain, current = [], error
    while current is not None:
        chain.append(current)
        current = current.__cause__
    return not (ray_exceptions and any(isinstance(e, ray_exceptions.RayError) for e in chain))


def post_mortem(error: BaseException) -> None:
    """The post-mortem debugger at the frame where the node's own error was raised."""
    import pdb

    cause = innermost(error)
    print(f"post-mortem: {type(cause).__name__}: {cause}", file=sys.stderr)
    pdb.post_mortem(cause.__traceback__)
