"""ExecutionPlan: one training step as an ordered list of items, with text, JSON and DOT forms.

Item kinds:
- call        a node's worker runs on every rank of a pool
- controller  a node's function runs on the controller
- dispatch    the controller sends a node's input keys to the pool's ranks (split/broadcast/rank0)
- collect     the controller gathers the ranks' outputs (concat, or rank 0's)
- reload / offload   model parts (weights, grads, optimizer, kv_cache) move to / off the device
- sync        the trained weights reach the rollout engine, for the next step's generation
              (in place when they share the module; sent to the rollout pool's ranks when
              the model's rollout_pool is another pool)

Items run in list order on each pool; `deps` says what must finish first, so the executor may
start an item as soon as its deps are done (items with no path between them may overlap).
No torch or ray here.
"""

import json

import attrs

from flowrl.render import dot_escape

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
    how: str = ""  # split / broadcast / rank0 for dispatch; concat / rank0 for collect
    deps: tuple[int, ...] = ()
    note: str = ""
    to_pool: str | None = None  # for a sync to another pool: the pool that receives

    def describe(self) -> str:
        keys = ", ".join(self.keys)
        parts = ", ".join(self.parts)
        return {
            "call": f"{self.node}  ({self.model}, {self.mode})",
            "controller": f"{self.node}",
            "dispatch": f"{self.node}: {self.how} [{keys}]",
            "collect": f"{self.node}: {self.how} [{keys or 'metrics'}]",
            "reload": f"{self.model}: {parts}",
            "offload": f"{self.model}: {parts}",
            "sync": f"{self.model}: weights train -> rollout"
            + (f" on pool {self.to_pool}" if self.to_pool else ""),
        }[self.kind] + (f"  # {self.note}" if self.note else "")


@attrs.frozen
class ExecutionPlan:
    file: str
    pools: dict[str, dict]  # name -> workers, device, offload (resolved), models, memory
    batch: dict  # prompts, samples, rows, per-node rows
    items: tuple[Item, ...]
    overlaps: tuple[tuple[str, tuple[str, ...]], ...]  # item name -> names it may run beside
    warnings: tuple[str, ...] = ()

    def item(self, name: str) -> Item:
        return next(i for i in self.items if i.name == name)

    def text(self) -> str:
        lines = [f"plan for {self.file}", "pools"]
        for name, pool in self.pools.items():
            lines.append(
                f"  {name}: {pool['workers']} worker(s) x {pool['device']}, "
                f"offload={pool['offload']} ({pool['offload_reason']})"
            )
            if pool["nodes"] > 1:
                where = "; ".join(
                    f"node {k}: rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}"
                    for k, r in enumerate(pool["ranks_by_node"])
                )
                lines.append(
                    f"    placement: {pool['strategy']} over {pool['nodes']} nodes ({where})"
                )
            for model, info in pool["models"].items():
                lines.append(f"    {model}: {info}")
        b = self.batch
        lines.append(f"batch: {b['prompts']} prompts x {b['samples']} samples = {b['rows']} rows")
        lines.append("step")
        width = len(str(len(self.items)))
        for item in self.items:
            where = item.pool or "controller"
            after = f"  after {','.join(map(str, item.deps))}" if item.deps else ""
            lines.append(
                f"  {item.id:>{width}}  {item.kind:<10} {where:<10} {item.describe()}{after}"
            )
        if self.overlaps:
            lines.append("may overlap")
            for name, others in self.overlaps:
                lines.append(f"  {name} || {', '.join(others)}")
        lines.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(lines) + "\n"

    def to_json(self) -> str:
        data = {
            "file": self.file,
            "pools": self.pools,
            "batch": self.batch,
            "items": [attrs.asdict(i) for i in self.items],
            "overlaps": {name: list(others) for name, others in self.overlaps},
            "warnings": list(self.warnings),
        }
        return json.dumps(data, indent=2, sort_keys=True)

    def to_dot(self) -> str:
        """The plan as DOT: items clustered by pool; transitions and dispatch/collect styled."""
        style = {
            "call": 'shape=box, style="filled", fillcolor="#cfe2f3"',
            "controller": 'shape=box, style="rounded,filled", fillcolor="#fff2cc"',
            "dispatch": 'shape=invhouse, style="filled", fillcolor="#d9ead3"',
            "collect": 'shape=house, style="filled", fillcolor="#d9ead3"',
            "reload": 'shape=hexagon, style="filled", fillcolor="#f4cccc"',
            "offload": 'shape=hexagon, style="filled,dashed", fillcolor="#ead1dc"',
            "sync": 'shape=doubleoctagon, style="filled", fillcolor="#fce5cd"',
        }
        lines = ["digraph plan {", "  rankdir=TB;", '  node [fontname="Helvetica"];']
        groups: dict[str | None, list[Item]] = {}
        for item in self.items:
            groups.setdefault(item.pool, []).append(item)
        for pool in sorted(groups, key=lambda p: (p is not None, p or "")):
            indent = "  "
            if pool is not None:
                lines.append(f'  subgraph "cluster_{dot_escape(pool)}" {{')
                lines.append(f'    label="pool {dot_escape(pool)}"; style=dashed;')
                indent = "    "
            for item in groups[pool]:
                label = f"{item.id}. {item.kind}\\n{dot_escape(item.describe())}"
                lines.append(f'{indent}"{item.id}" [label="{label}", {style[item.kind]}];')
            if pool is not None:
                lines.append("  }")
        for item in self.items:
            for dep in item.deps:
                lines.append(f'  "{dep}" -> "{item.id}";')
        lines.append("}")
        return "\n".join(lines) + "\n"
