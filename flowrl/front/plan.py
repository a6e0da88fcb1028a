"""ExecutionPlan: one training step as an ordered list of items. Its text, JSON and DOT forms
are flowrl/front/plan_text.py.

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

from typing import Any

import attrs
import networkx as nx

from flowrl.front import plan_text
from flowrl.front.pipeline import PipelinePlan

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

    def filters(self) -> tuple[str, ...]:
        """The filter nodes (rows = "filter") of the step, in plan order."""
        return tuple(n for n in self.graph.order if self.spec.nodes[n].spec.rows == "filter")

    def after(self, node: str) -> list[str]:
        """The nodes that run after `node` on its output rows, in plan order."""
        later = nx.descendants(self.graph.dag, node)
        return [n for n in self.graph.order if n in later]

    def text(self) -> str:
        """The plan as `flowrl plan` prints it (flowrl/front/plan_text.py)."""
        return plan_text.text(self)

    def to_json(self) -> str:
        """The plan as `flowrl plan --json` prints it."""
        return plan_text.to_json(self)

    def to_dot(self) -> str:
        """The plan as DOT, as `flowrl render --plan` draws it."""
        return plan_text.to_dot(self)
