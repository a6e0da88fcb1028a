"""ExecutionPlan: one training step as an ordered list of items, with text, JSON and DOT forms.

Item kinds:
- call        a node's worker runs on every rank of a pool
- controller  a node's function runs on the controller
- dispatch    the controller sends a node's input keys to the pool's ranks (split/broadcast/rank0)
- collect     the controller gathers the ranks' outputs (concat, or rank 0's)
- reload / offload   model parts (weights, grads, optimizer, rollout_weights, kv_cache) move to
              / off the device (rollout_weights: the unsharded copy an fsdp model generates from)
- sync        the trained weights reach the rollout engine, for the next step's generation
              (in place when they share the module; sent to the rollout pool's ranks when
              the model's rollout_pool is another pool)

Items run in list order on each pool; `deps` says what must finish first, so the executor may
start an item as soon as its deps are done (items with no path between them may overlap).
No torch or ray here.
"""

import json
from typing import Any

import attrs
import networkx as nx

from flowrl.front.pipeline import PipelinePlan
from flowrl.front.render import dot_escape, levels, rank_lines

TRANSITIONS = ("reload", "offload", "sync")


@attrs.frozen
class Item:
    id: int
    kind: str
    name: str  # unique, e.g. "generate", "dispatch:generate", "reload:policy"
    pool: str | None = None  # None: the controller
    node: str | None = None
    model: str | None = None
    mode: str | None = None
    parts: tuple[str, ...] = ()  # for transitions
    keys: tuple[str, ...] = ()  # for dispatch / collect
    how: str = ""  # dispatch: split / broadcast / rank0 (DISPATCHES); collect: concat / rank0
    deps: tuple[int, ...] = ()
    note: str = ""
    ranks: int = 0  # for dispatch: the ranks the rows go to
    to_pool: str | None = None  # for a sync to another pool: the pool that receives

    def describe(self) -> str:
        keys = ", ".join(self.keys)
        parts = ", ".join(self.parts)
        return {
            "call": f"{self.node}  ({self.model}, {self.mode})",
            "controller": f"{self.node}",
            "dispatch": f"{self.node}: {self.how}{', 1 rank' * (self.ranks == 1)} [{keys}]",
            "collect": f"{self.node}: {self.how} [{keys or 'metrics'}]",
            "reload": f"{self.model}: {parts}",
            "offload": f"{self.model}: {parts}",
            "sync": f"{self.model}: weights train -> rollout"
            + (f" on pool {self.to_pool}" if self.to_pool else ""),
        }[self.kind] + (f"  # {self.note}" if self.note else "")


@attrs.frozen
class PoolPlan:
    """One pool as the runtime builds it: its ranks and where they go, the models its ranks
    load, the nodes they run, and the resolved offload policy."""

    name: str
    workers: int  # ranks, one process each
    device: str  # "cpu" or "cuda"
    cpus_per_worker: int
    devices_per_worker: int
    offload: str  # resolved: "never" or "always"
    offload_reason: str
    machines: int  # machines the pool spans (`nodes` in the graph file's [pools.<name>])
    strategy: str  # training strategy: "ddp" (replicated) or "fsdp" (sharded)
    sharded: tuple[str, ...]  # the models fsdp shards here (all but generate-only ones)
    placement: str  # Ray placement-group strategy, resolved
    bundles: tuple[tuple[int, ...], ...]  # the ranks of each placement bundle
    ranks_by_node: tuple[tuple[int, ...], ...]  # the ranks on each machine
    configs: dict[str, Any]  # model name -> schema.ModelConfig as loaded on this pool
    node_ids: tuple[str, ...]  # the nodes whose workers run here, in file order
    updates_per_step: dict[str, int]  # trainable model -> optimizer steps per training step
    model_lines: dict[str, str]  # model name -> display line: path, head, role, sizes per rank
    memory_bytes: dict[str, dict[str, int]]  # model name -> part -> estimated bytes per rank


@attrs.frozen
class BatchPlan:
    prompts: int  # prompts per step
    samples: int  # samples per prompt, at the widest point of the step
    rows: int  # prompts x samples
    rows_per_node: dict[str, int]  # node id -> rows it receives


@attrs.frozen
class ValidationPlan:
    """What validation runs: the nodes that lead to `scores`, rollout nodes made greedy."""

    nodes: tuple[str, ...] = ()  # empty: the graph has no scores to validate
    greedy: tuple[str, ...] = ()  # rollout nodes among them (do_sample = False, n = 1)


@attrs.frozen
class RefillPlan:
    """A step that refills through a filter node (DAPO's dynamic sampling): the controller runs
    `before` on a prompt batch, keeps the rows the filter keeps, and repeats on fresh prompt
    batches until `groups` groups are kept or `rounds` batches are spent; it trims to `groups`
    groups and runs `after` once on them. groups = 0: one batch, whatever the filter keeps."""

    node: str  # the filter
    groups: int
    rounds: int
    before: tuple[str, ...]  # the filter's ancestors and the filter, in plan order
    after: tuple[str, ...]  # every other node

    def text(self) -> str:
        runs = ", ".join(self.before)
        if not self.groups:
            return f"filter: {self.node} drops rows before {', '.join(self.after)}"
        return (
            f"refill: {runs} run on up to {self.rounds} prompt batches until {self.node} "
            f"has kept {self.groups} groups; then {', '.join(self.after)} on those groups"
        )


@attrs.frozen
class ExecutionPlan:
    file: str
    pools: dict[str, PoolPlan]
    batch: BatchPlan
    items: tuple[Item, ...]
    overlaps: tuple[tuple[str, tuple[str, ...]], ...]  # item name -> names it may run beside
    warnings: tuple[str, ...] = ()
    validation: ValidationPlan = ValidationPlan()
    graph: Any = attrs.field(default=None, eq=False, repr=False)  # the graph.Graph that runs
    refill: RefillPlan | None = None  # a filter node that refills the step
    after_warmup: tuple[str, ...] = ()  # train nodes that skip the first run.critic_warmup steps
    pipeline: PipelinePlan | None = None  # run.staleness > 0: the two stages and their queue

    @property
    def spec(self):
        """The GraphSpec that runs (without the nodes the graph skips)."""
        return self.graph.spec

    def item(self, name: str) -> Item:
        return next(i for i in self.items if i.name == name)

    def pool_of(self, node: str) -> str | None:
        """The pool a node runs on; None for a controller node."""
        return next((p.name for p in self.pools.values() if node in p.node_ids), None)

    def text(self) -> str:
        lines = [f"plan for {self.file}", "pools"]
        for name, pool in self.pools.items():
            lines.append(
                f"  {name}: {pool.workers} worker(s) x {pool.device}, {pool.strategy}, "
                f"offload={pool.offload} ({pool.offload_reason}); sizes per rank"
            )
            if pool.machines > 1:
                where = "; ".join(
                    f"node {k}: rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}"
                    for k, r in enumerate(pool.ranks_by_node)
                )
                lines.append(
                    f"    placement: {pool.placement} over {pool.machines} nodes ({where})"
                )
            for model, info in pool.model_lines.items():
                lines.append(f"    {model}: {info}")
        b = self.batch
        lines.append(f"batch: {b.prompts} prompts x {b.samples} samples = {b.rows} rows")
        lines += self.filter_lines()
        if self.pipeline:
            lines += self.pipeline.lines()
        if self.after_warmup:
            lines.append(
                f"critic warm-up: {', '.join(self.after_warmup)} skip steps 1-"
                f"{self.spec.run.critic_warmup}; the other nodes run"
            )
        width = len(str(len(self.items)))
        for title, items in self._sections():
            lines.append(title)
            for item in items:
                where = item.pool or "controller"
                after = f"  after {','.join(map(str, item.deps))}" if item.deps else ""
                lines.append(
                    f"  {item.id:>{width}}  {item.kind:<10} {where:<10} {item.describe()}{after}"
                )
        if self.overlaps or self.pipeline:
            lines.append("may overlap")
            for name, others in self.overlaps:
                lines.append(f"  {name} || {', '.join(others)}")
            if self.pipeline:
                p = self.pipeline
                ahead = "step s+1" if p.staleness == 1 else f"step s+1 .. s+{p.staleness}"
                ahead = "its rounds" if p.partial else ahead
                lines.append(
                    f"  the rollout stage ({ahead}) || the train stage (step s): every "
                    "item of one with every item of the other"
                )
        lines.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(lines) + "\n"

    def _sections(self) -> list[tuple[str, list[Item]]]:
        """The step's items under their headings: one list, or one per stage."""
        if not self.pipeline:
            return [("step", list(self.items))]
        p, by_id = self.pipeline, {i.id: i for i in self.items}
        heading = (
            f"rollout stage (pool {p.rollout_pool}): step s+{p.staleness}, with the weights of "
            "update s-1"
        )
        if p.partial:
            ids = ", ".join(map(str, p.generate_items))
            after = ", ".join(map(str, p.after_items))
            heading = f"rollout stage (pool {p.rollout_pool}): items {ids} every round; {after}"
            heading += " on each batch"
        return [
            (heading, [by_id[i] for i in p.rollout_items]),
            (
                f"queue -> train stage (pool {', '.join(p.train_pools)}): step s",
                [by_id[i] for i in sorted((*p.train_items, p.sync_item))],
            ),
        ]

    def _stage_names(self) -> dict:
        """Pool -> the stage it runs, for the DOT's box labels ({} when synchronous)."""
        if not self.pipeline:
            return {}
        return {self.pipeline.rollout_pool: "rollout"} | dict.fromkeys(
            self.pipeline.train_pools, "train"
        )

    def _through_queue(self, dag: nx.DiGraph) -> nx.DiGraph:
        """The item DAG with every edge from the rollout stage to the train stage replaced
        by one through the queue node, and the sync's edge to the rollout pool dropped."""
        rollout = {str(i) for i in self.pipeline.rollout_items}
        out = nx.DiGraph()
        out.add_nodes_from([*dag.nodes, "queue"])
        for a, b in dag.edges:
            if a in rollout and b not in rollout:
                out.add_edges_from([(a, "queue"), ("queue", b)])
            elif b not in rollout or a in rollout:
                out.add_edge(a, b)
        return out

    def _queue_lines(self) -> list[str]:
        p = self.pipeline
        label = (
            f"queue\\nat most {p.queue_size} batch(es) of {p.rows} rows\\n"
            f"weights up to {p.staleness} update(s) old"
        )
        return [
            f'  "queue" [label="{label}", shape=cylinder, style="filled", fillcolor="#eeeeee"];'
        ]

    def filters(self) -> tuple[str, ...]:
        """The filter nodes (rows = "filter") of the step, in plan order."""
        return tuple(n for n in self.graph.order if self.spec.nodes[n].spec.rows == "filter")

    def after(self, node: str) -> list[str]:
        """The nodes that run after `node` on its output rows, in plan order."""
        later = nx.descendants(self.graph.dag, node)
        return [n for n in self.graph.order if n in later]

    def filter_lines(self) -> list[str]:
        """For each filter node: how it refills (if it does) and the rows the nodes after it
        receive (what it keeps: at most the rows it receives, or its refill's target)."""
        lines = []
        for node in self.filters():
            after = self.after(node)
            refill = self.refill if self.refill and self.refill.node == node else None
            if refill and refill.groups:
                lines.append(refill.text())
            if not after:
                continue
            rows, names = self.batch.rows_per_node[after[0]], ", ".join(after)
            if refill and refill.groups:
                samples = rows // refill.groups
                lines.append(
                    f"after {node}: {names} receive {refill.groups} groups x {samples} samples "
                    f"= {rows} rows (fewer when the {refill.rounds} prompt batches run out)"
                )
            else:
                samples = rows // self.batch.prompts
                lines.append(
                    f"after {node}: {names} receive the rows {node} keeps: at most {rows} "
                    f"({self.batch.prompts} prompts x {samples} samples), varying by step"
                )
        return lines

    def to_json(self) -> str:
        data = {
            "file": self.file,
            "pools": {name: attrs.asdict(pool) for name, pool in self.pools.items()},
            "batch": attrs.asdict(self.batch),
            "validation": attrs.asdict(self.validation),
            "refill": attrs.asdict(self.refill) if self.refill else None,
            "after_warmup": list(self.after_warmup),
            "pipeline": attrs.asdict(self.pipeline) if self.pipeline else None,
            "items": [attrs.asdict(i) for i in self.items],
            "overlaps": {name: list(others) for name, others in self.overlaps},
            "warnings": list(self.warnings),
        }
        return json.dumps(data, indent=2, sort_keys=True)

    def to_dot(self) -> str:
        """The plan as DOT, top to bottom in step order (each item one row below the last item
        it waits for): pool items in their pool's box, controller items in a box of their own;
        transitions and dispatch/collect styled."""
        style = {
            "call": 'shape=box, style="filled", fillcolor="#cfe2f3"',
            "controller": 'shape=box, style="rounded,filled", fillcolor="#fff2cc"',
            "dispatch": 'shape=invhouse, style="filled", fillcolor="#d9ead3"',
            "collect": 'shape=house, style="filled", fillcolor="#d9ead3"',
            "reload": 'shape=hexagon, style="filled", fillcolor="#f4cccc"',
            "offload": 'shape=hexagon, style="filled,dashed", fillcolor="#ead1dc"',
            "sync": 'shape=doubleoctagon, style="filled", fillcolor="#fce5cd"',
        }
        lines = ["digraph plan {", "  rankdir=TB; newrank=true;", '  node [fontname="Helvetica"];']
        groups: dict[str | None, list[Item]] = {}
        for item in self.items:
            groups.setdefault(item.pool, []).append(item)
        stage = self._stage_names()
        for pool in sorted(groups, key=lambda p: (p is not None, p or "")):
            name, label = ("(controller)", "controller") if pool is None else (pool, f"pool {pool}")
            if pool in stage:
                label += f" ({stage[pool]} stage)"
            lines.append(f'  subgraph "cluster_{dot_escape(name)}" {{')
            lines.append(
                f'    label="{dot_escape(label)}"; style={"solid" if pool is None else "dashed"};'
            )
            for item in groups[pool]:
                text = f"{item.id}. {item.kind}\\n{dot_escape(item.describe())}"
                lines.append(f'    "{item.id}" [label="{text}", {style[item.kind]}];')
            lines.append("  }")
        dag = nx.DiGraph()
        dag.add_nodes_from(str(i.id) for i in self.items)
        dag.add_edges_from((str(d), str(i.id)) for i in self.items for d in i.deps)
        if self.pipeline:  # the stages meet at the queue, not item to item
            dag = self._through_queue(dag)
            lines += self._queue_lines()
        lines += rank_lines(levels(dag))
        for a, b in sorted(dag.edges, key=lambda e: (_order(e[1]), _order(e[0]))):
            lines.append(f'  "{a}" -> "{b}";')
        if self.pipeline:
            p = self.pipeline
            first = p.rollout_items[0]
            lines.append(
                f'  "{p.sync_item}" -> "{first}" [style=dashed, constraint=false, '
                f'label="weights, loaded {p.staleness + 1} steps later"];'
            )
        lines.append("}")
        return "\n".join(lines) + "\n"


def _order(name: str) -> tuple:
    """Sort key of a DOT node name: item ids in number order, the queue after them."""
    return (0, int(name)) if name.isdigit() else (1, 0)
