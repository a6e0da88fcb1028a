"""Graph -> ExecutionPlan. A pure function: no torch, no ray, nothing loaded.

Passes, in order:
1. batch arithmetic (flowrl/front/batching.py): rows per node (prompts x samples), groups,
   mini-batches vs ranks, the refill and the critic warm-up;
2. placement: a model node runs on its model's pool; other nodes on the controller;
3. residency: per pool, which (model, part) must be on the device for each call, and the
   reload / offload / sync transitions the pool's offload policy implies;
4. dispatch / collect items around every call; dependencies; what may overlap;
5. with run.staleness > 0, the split into a rollout and a train stage (flowrl/front/pipeline.py).
"""

import math
from pathlib import Path

import networkx as nx

from flowrl.errors import Collector, GraphErrors
from flowrl.front import batching, dsl, memory, pipeline, schema
from flowrl.front.graph import DATASET, Graph, build
from flowrl.front.plan import BatchPlan, ExecutionPlan, Item, PoolPlan, ValidationPlan
from flowrl.nodespec import RolloutParams

# What a call must find on the device, by mode.
NEEDS = {
    "rollout": ("weights", "kv_cache"),
    "inference": ("weights",),
    "train": ("weights", "grads", "optimizer"),
}
# A model sharded by fsdp generates from an unsharded copy (`rollout_weights`), not its shards.
SHARDED_ROLLOUT_NEEDS = ("rollout_weights", "kv_cache")
PARTS = ("weights", "grads", "optimizer", "rollout_weights", "kv_cache")


def compile_file(file: str | Path, overrides=(), base_dir: str | Path = "") -> ExecutionPlan:
    """Parse, check and compile a graph file; raises GraphErrors listing every problem: the
    file's own, then those of the stages after it (wiring, batch arithmetic, the nodes' check
    hooks) as far as the file lets them run. `base_dir`: where its relative paths resolve
    (default: the file's folder)."""
    spec, problems = dsl.load_partial(file, list(overrides), base_dir)
    if spec is None:
        raise GraphErrors(problems)
    try:
        built = build(spec)
    except GraphErrors as e:  # unwired: the nodes' own checks still run, on file-order rows
        later = Collector(spec.file)
        try:
            batching.unwired_findings(spec, later)
        except Exception:  # a hook that trips over a problem already reported
            later.problems = []
        raise GraphErrors([*problems, *e.problems, *later.problems]) from None
    except Exception:
        if problems:
            raise GraphErrors(problems) from None
        raise
    try:
        plan = compile_graph(built)
    except GraphErrors as e:
        raise GraphErrors([*problems, *e.problems]) from None
    except Exception:
        if problems:  # a later stage tripped over a problem already reported
            raise GraphErrors(problems) from None
        raise
    if problems:
        raise GraphErrors(problems)
    return plan


def compile_graph(built: Graph) -> ExecutionPlan:
    """The execution plan of one training step; raises GraphErrors on bad batch arithmetic."""
    errors = Collector(built.spec.file)
    refill = batching.refill_plan(built, errors)
    batch, warnings = batching.batch_plan(built, refill, errors)
    batching.check_save_inputs(built, errors)
    after_warmup = batching.after_warmup_nodes(built, refill, errors)
    errors.raise_if_any()
    pools = _pools(built, batch, warnings)
    warnings += _lr_warnings(built.spec)
    items = _Builder(built, pools).build()
    pipeline_plan = pipeline.split(built, items, batch.rows, refill, errors, warnings)
    errors.raise_if_any()
    return ExecutionPlan(
        file=built.spec.file,
        pools=pools,
        batch=batch,
        items=tuple(items),
        overlaps=_overlaps(items),
        warnings=tuple(built.warnings) + tuple(warnings),
        validation=_validation(built),
        graph=built,
        refill=refill,
        after_warmup=after_warmup,
        pipeline=pipeline_plan,
    )


# -- 2. placement and 3. the residency policy ----------------------------------------------


def _pools(graph: Graph, batch: BatchPlan, warnings: list) -> dict[str, PoolPlan]:
    """Every pool: which models it loads, which nodes it runs, which of them are sharded, their
    estimated sizes per rank, the resolved offload policy and the placement of its ranks. The
    one place placement is decided (from the spec's `pool` and `rollout_pool` settings)."""
    spec = graph.spec
    out = {}
    for name, pool in spec.pools.items():
        configs = spec.models_on(name)
        node_ids = tuple(n for n in spec.nodes if spec.pool_of(n) == name)
        modes = {
            m: {spec.nodes[n].mode for n in node_ids if spec.nodes[n].model == m} for m in configs
        }
        # fsdp shards the models that run forward passes here; a model that only generates
        # here (a rollout pool's copy) needs its whole weights on every rank anyway
        sharded = tuple(m for m in configs if pool.strategy == "fsdp" and modes[m] - {"rollout"})
        tokens = math.ceil(batch.rows / pool.workers)  # a rank's rows
        sizes = {
            m: memory.model_bytes(
                c,
                spec.base_dir,
                modes[m],
                _cache_tokens(spec, m, tokens),
                pool.workers,
                m in sharded,
                pool.device,
            )
            for m, c in configs.items()
        }
        warnings += _dtype_warnings(name, pool, configs, sharded)
        offload, reason = memory.offload_policy(pool, sizes)
        group_strategy, ranks_by_node = placement(pool)
        bundles = ranks_by_node if pool.nodes > 1 else [[r] for r in range(pool.workers)]
        updates = {}
        for n in node_ids:
            decl = spec.nodes[n]
            if decl.mode == "train":
                count = decl.spec.updates(decl.params, batch.rows_per_node[n])
                updates[decl.model] = updates.get(decl.model, 0) + count
        out[name] = PoolPlan(
            name=name,
            workers=pool.workers,
            device=pool.device,
            cpus_per_worker=pool.cpus_per_worker,
            devices_per_worker=pool.devices_per_worker,
            offload=offload,
            offload_reason=reason,
            machines=pool.nodes,
            strategy=pool.strategy,
            sharded=sharded,
            placement=group_strategy,
            bundles=tuple(tuple(b) for b in bundles),
            ranks_by_node=tuple(tuple(r) for r in ranks_by_node),
            configs=configs,
            node_ids=node_ids,
            updates_per_step=updates,
            model_lines={
                m: memory.model_line(c, sizes[m], pool.workers if m in sharded else 0)
                for m, c in configs.items()
            },
            memory_bytes=sizes,
        )
    return out


def _cache_tokens(spec, model: str, rows: int) -> int:
    """KV-cache positions for generating `rows` rows with `model`: rows x (prompt + response)."""
    new_tokens = max(
        (
            d.params.max_new_tokens
            for d in spec.nodes.values()
            if d.model == model and isinstance(d.params, RolloutParams)
        ),
        default=0,
    )
    return rows * (spec.data.max_prompt_len + new_tokens)


LR_RANGE = (1e-9, 0.1)  # AdamW learning rates outside this never train a transformer well


def _lr_warnings(spec) -> list[str]:
    """A trainable model's lr far outside any sane range: accepted (it is a number), but
    such a run dies quietly (gradient norm 0 after a step or two), so `check` says so."""
    low, high = LR_RANGE
    return [
        f"[models.{name}] lr = {m.lr:g} is far outside the usual range for AdamW on a language "
        f"model (about 1e-7 to 1e-4; anything below {low:g} or above {high:g} does not train): "
        "lower it, e.g. 1e-6"
        for name, m in spec.models.items()
        if m.trainable and not low <= m.lr <= high
    ]


def _dtype_warnings(name: str, pool, configs: dict, sharded: tuple) -> list[str]:
    """param_dtype is mixed precision on cuda (FSDP2's, autocast under ddp): it has no
    effect on CPU, so say so."""
    out = []
    for model, config in configs.items():
        if config.param_dtype and config.param_dtype != config.dtype and pool.device != "cuda":
            out.append(
                f"[models.{model}] param_dtype = {config.param_dtype!r} applies on cuda; on "
                f"pool {name} ({pool.device}) it computes in {config.dtype}"
            )
    return out


def needs(pool: PoolPlan, model: str, mode: str) -> tuple[str, ...]:
    """The parts of `model` a call of `mode` on `pool` must find on the device."""
    if mode == "rollout" and model in pool.sharded:
        return SHARDED_ROLLOUT_NEEDS
    return NEEDS[mode]


def placement(pool: schema.PoolConfig) -> tuple[str, list[list[int]]]:
    """(Ray placement-group strategy, the ranks on each of the machines the pool spans, its
    `nodes`). Ranks are consecutive on a machine (so its ranks could share fast links); PACK on
    one machine and STRICT_SPREAD over several, unless set. The bundles are made from these
    by `_pools` (`PoolPlan.bundles`): a bundle per rank on one machine (Ray may still spread
    them when a machine is full, as PACK allows), a bundle per machine otherwise."""
    per_node = pool.workers // pool.nodes
    ranks = [list(range(k * per_node, (k + 1) * per_node)) for k in range(pool.nodes)]
    return pool.placement or ("PACK" if pool.nodes == 1 else "STRICT_SPREAD"), ranks


# -- 4. items -------------------------------------------------------------------------------


class _Builder:
    """Walks the nodes in order, emitting each one's items and its pool's transitions."""

    def __init__(self, graph: Graph, pools: dict):
        self.graph, self.spec, self.pools = graph, graph.spec, pools
        self.items: list[Item] = []
        self.done: dict[str, int] = {}  # node id -> the item whose end means its output is ready
        self.last_on_pool: dict[str, int] = {}
        self.resident: dict[str, set] = {p: set() for p in pools}
        rollout_models = {d.model for d in self.spec.nodes.values() if d.mode == "rollout"}
        self.synced = rollout_models
        calls = [n for n in graph.order if self.spec.nodes[n].model]
        self.calls_on = {p: [n for n in calls if self._pool(n) == p] for p in pools}
        for pool, info in pools.items():
            if info.offload == "never":  # everything stays on the device for the whole run
                self.resident[pool] = {
                    (self.spec.nodes[n].model, part)
                    for n in self.calls_on[pool]
                    for part in self._needs(n)
                }

    def _pool(self, node: str) -> str:
        return self.spec.pool_of(node)

    def _needs(self, node: str) -> tuple[str, ...]:
        decl = self.spec.nodes[node]
        return needs(self.pools[self._pool(node)], decl.model, decl.mode)

    def add(self, kind: str, name: str, deps=(), **fields) -> int:
        item = Item(
            id=len(self.items) + 1, kind=kind, name=name, deps=tuple(sorted(set(deps))), **fields
        )
        self.items.append(item)
        if item.pool is not None and kind != "dispatch" and kind != "collect":
            self.last_on_pool[item.pool] = item.id
        return item.id

    def pool_deps(self, pool: str) -> list[int]:
        return [self.last_on_pool[pool]] if pool in self.last_on_pool else []

    def build(self) -> list[Item]:
        for node in self.graph.order:
            decl = self.spec.nodes[node]
            preds = [self.done[p] for p in self.graph.dag.predecessors(node)]
            if decl.model is None:
                self.done[node] = self.add("controller", node, preds, node=node)
            else:
                self._call(node, decl, preds)
        return self.items

    def _written_before(self, node: str, decl) -> tuple[str, ...]:
        """The node's `reads_if_written` keys that a node before it writes."""
        wanted = [decl.rename.get(k, k) for k in decl.spec.reads_if_written]
        if not wanted:
            return ()
        before = nx.ancestors(self.graph.dag, node)
        written = {k for n in before if n in self.spec.nodes for k in self.spec.nodes[n].writes}
        return tuple(k for k in wanted if k in written and k not in decl.reads)

    def _call(self, node: str, decl, preds: list[int]) -> None:
        pool, model, mode = self._pool(node), decl.model, decl.mode
        self._move(pool, "reload", {(model, p) for p in self._needs(node)} - self.resident[pool])
        workers = self.pools[pool].workers
        how = decl.spec.dispatch
        dispatch = self.add(
            "dispatch",
            f"dispatch:{node}",
            preds,
            pool=pool,
            node=node,
            keys=decl.reads + self._written_before(node, decl),
            how=how,
            ranks=workers,
        )
        call = self.add(
            "call",
            node,
            [dispatch, *self.pool_deps(pool)],
            pool=pool,
            node=node,
            model=model,
            mode=mode,
        )
        gather = "concat" if how == "split" else "rank0"
        self.done[node] = self.add(
            "collect", f"collect:{node}", [call], pool=pool, node=node, keys=decl.writes, how=gather
        )
        if mode == "train" and model in self.synced:
            to_pool = self.spec.models[model].rollout_pool
            to_pool = to_pool if to_pool and to_pool != pool else None
            k = self.spec.run.staleness
            ahead = bool(to_pool and k)  # the rollout pool loads it later, between generates
            sync = self.add(
                "sync",
                f"sync:{model}",
                self.pool_deps(pool) + (self.pool_deps(to_pool) if to_pool and not ahead else []),
                pool=pool,
                model=model,
                to_pool=to_pool,
                note=f"loaded before generating step s+{k + 1}"
                if ahead
                else "for the next step's generate",
            )
            if to_pool and not ahead:  # the rollout pool is busy receiving until then
                self.last_on_pool[to_pool] = sync
        if self.pools[pool].offload == "always":
            later = self.calls_on[pool][self.calls_on[pool].index(node) + 1 :]
            needed = set()
            if later:
                needed = {(self.spec.nodes[later[0]].model, p) for p in self._needs(later[0])}
            self._move(pool, "offload", {r for r in self.resident[pool] if r not in needed})

    def _move(self, pool: str, kind: str, parts: set) -> None:
        for model in sorted({m for m, _ in parts}):
            names = tuple(p for p in PARTS if (model, p) in parts)
            self.add(
                kind,
                f"{kind}:{model}:{len(self.items) + 1}",
                self.pool_deps(pool),
                pool=pool,
                model=model,
                parts=names,
            )
            if kind == "reload":
                self.resident[pool] |= {(model, p) for p in names}
            else:
                self.resident[pool] -= {(model, p) for p in names}


def _validation(built: Graph) -> ValidationPlan:
    """Validation runs the writer of `scores` and the nodes before it, with greedy rollouts."""
    writer = built.writers.get("scores")
    if writer in (None, DATASET):
        return ValidationPlan()
    # only what `scores` is computed from: row edges order nodes, they carry no data
    dag = built.dag
    data = nx.subgraph_view(dag, filter_edge=lambda a, b: dag.edges[a, b]["kind"] != "rows")
    needed = {writer} | nx.ancestors(data, writer)
    nodes = tuple(n for n in built.order if n in needed)
    greedy = tuple(n for n in nodes if built.spec.nodes[n].mode == "rollout")
    return ValidationPlan(nodes, greedy)


def _overlaps(items: list[Item]) -> tuple:
    """For each call / controller item, the others with no dependency path to or from it."""
    dag = nx.DiGraph()
    dag.add_nodes_from(i.id for i in items)
    dag.add_edges_from((d, i.id) for i in items for d in i.deps)
    work = [i for i in items if i.kind in ("call", "controller")]
    out = []
    for item in work:
        related = nx.ancestors(dag, item.id) | nx.descendants(dag, item.id)
        free = tuple(o.name for o in work if o.id != item.id and o.id not in related)
        if free:
            out.append((item.name, free))
    return tuple(out)
