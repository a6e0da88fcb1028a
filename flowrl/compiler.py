"""Graph -> ExecutionPlan. A pure function: no torch, no ray, nothing loaded.

Passes, in order:
1. batch arithmetic: rows per node (prompts x samples), groups, mini-batches vs ranks;
2. placement: a model node runs on its model's pool; other nodes on the controller;
3. residency: per pool, which (model, part) must be on the device for each call, and the
   reload / offload / sync transitions the pool's offload policy implies;
4. dispatch / collect items around every call; dependencies; what may overlap.
"""

import json
from pathlib import Path

import networkx as nx

from flowrl import schema
from flowrl.errors import Collector
from flowrl.graph import Graph
from flowrl.plan import ExecutionPlan, Item

# What a call must find on the device, by mode.
NEEDS = {
    "rollout": ("weights", "kv_cache"),
    "inference": ("weights",),
    "train": ("weights", "grads", "optimizer"),
}
PARTS = ("weights", "grads", "optimizer", "kv_cache")
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_MEMORY_GB = {"cuda": 80.0, "cpu": 0.0}
GB = 1024**3


def compile_graph(graph: Graph) -> ExecutionPlan:
    """The execution plan of one training step; raises GraphErrors on bad batch arithmetic."""
    errors = Collector(graph.spec.file)
    batch, warnings = _batch(graph, errors)
    errors.raise_if_any()
    pools = _pools(graph, batch)
    items = _Builder(graph, pools).build()
    return ExecutionPlan(
        graph.spec.file,
        pools,
        batch,
        tuple(items),
        _overlaps(items),
        tuple(graph.warnings) + tuple(warnings),
    )


# -- 1. batch arithmetic -------------------------------------------------------------------


def _batch(graph: Graph, errors: Collector) -> tuple[dict, list[str]]:
    spec, warnings = graph.spec, []
    prompts = spec.data.batch_size
    rows = {}  # node id -> rows it receives
    samples = {}  # node id -> samples per prompt upstream of and including it
    expanders = [n for n, d in spec.nodes.items() if d.spec.rows == "repeat" and d.params.n > 1]
    for node in graph.order:
        ancestors = nx.ancestors(graph.dag, node)
        n = 1
        for expander in expanders:
            if expander in ancestors:
                n *= spec.nodes[expander].params.n
        rows[node], samples[node] = prompts * n, n
    for expander in expanders:
        related = nx.ancestors(graph.dag, expander) | nx.descendants(graph.dag, expander)
        for other in spec.nodes:
            if other != expander and other not in related:
                errors.add(
                    f"[nodes.{other}]",
                    f"may run before or after [nodes.{expander}], "
                    f"which turns each row into {spec.nodes[expander].params.n}, so its "
                    "row count is ambiguous",
                    f"make it read a key of {expander}, or of a "
                    f"node before it, or set n = 1 on {expander}",
                )
    for node, decl in spec.nodes.items():
        where = f"[nodes.{node}]"
        if decl.spec.groups and samples[node] < 2:
            errors.add(
                where,
                f"{decl.uses} compares the samples of each prompt, but each prompt "
                "has 1 sample here",
                "set n >= 2 on the generate node before it",
            )
        mini = getattr(decl.params, "mini_batch_size", 0)
        if mini and mini > rows[node]:
            errors.add(
                where,
                f"mini_batch_size = {mini} exceeds the {rows[node]} rows of a step "
                f"({prompts} prompts x {samples[node]} samples)",
                f"set mini_batch_size <= {rows[node]} (0 = the whole batch)",
            )
        if getattr(decl.params, "on_policy", False) and (
            getattr(decl.params, "epochs", 1) > 1 or 0 < mini < rows[node]
        ):
            errors.add(
                where,
                "on_policy = true reuses the update's own log-probs as the old "
                "ones, which is exact only for one update per batch",
                "set epochs = 1 and mini_batch_size = 0, or on_policy = false with an "
                "old_logprob node",
            )
        if decl.model:
            workers = spec.pools[spec.pool_of(node)].workers
            per_update = mini or rows[node]
            if per_update < workers:
                warnings.append(
                    f"{where} gives {per_update} rows to {workers} ranks: some ranks "
                    "idle (raise data.batch_size or lower the pool's workers)"
                )
    total = max(rows.values(), default=prompts)
    return {
        "prompts": prompts,
        "samples": total // prompts,
        "rows": total,
        "rows_per_node": rows,
    }, warnings


# -- 2. placement and 3. the residency policy ----------------------------------------------


def _pools(graph: Graph, batch: dict) -> dict[str, dict]:
    spec = graph.spec
    out = {}
    for name, pool in spec.pools.items():
        models = spec.models_on(name)
        memory = {m: _model_bytes(m, c, graph, batch, name) for m, c in models.items()}
        offload, reason = _offload_policy(pool, memory)
        strategy, ranks_by_node = placement(pool)
        out[name] = {
            "workers": pool.workers,
            "device": pool.device,
            "offload": offload,
            "offload_reason": reason,
            "nodes": pool.nodes,
            "strategy": strategy,
            "ranks_by_node": ranks_by_node,
            "cpus_per_worker": pool.cpus_per_worker,
            "devices_per_worker": pool.devices_per_worker,
            "models": {m: _model_line(c, memory[m]) for m, c in models.items()},
            "memory_bytes": memory,
        }
    return out


def placement(pool: schema.PoolConfig) -> tuple[str, list[list[int]]]:
    """(placement-group strategy, the ranks on each of the pool's nodes). One node: a bundle
    per rank, PACK unless set. Several: a bundle per node holding workers / nodes ranks
    (consecutive, so a node's ranks could share fast links), STRICT_SPREAD unless set."""
    per_node = pool.workers // pool.nodes
    ranks = [list(range(k * per_node, (k + 1) * per_node)) for k in range(pool.nodes)]
    return pool.strategy or ("PACK" if pool.nodes == 1 else "STRICT_SPREAD"), ranks


def _offload_policy(pool: schema.PoolConfig, memory: dict) -> tuple[str, str]:
    if pool.offload != "auto":
        return pool.offload, "set in the file"
    if pool.device == "cpu":
        return "never", "auto: the device is host memory"
    budget = (pool.device_memory_gb or DEFAULT_MEMORY_GB[pool.device]) * GB
    need = sum(sum(parts.values()) for parts in memory.values())
    if any(not parts for parts in memory.values()):
        return "always", "auto: a model's size is unknown"
    verdict = "never" if need <= 0.9 * budget else "always"
    return verdict, f"auto: estimate {_size(need)} vs {_size(budget)} on the device"


def _model_line(config: schema.ModelConfig, memory: dict) -> str:
    role = "trainable" if config.trainable else "frozen"
    size = ", ".join(f"{p} {_size(b)}" for p, b in memory.items()) or "size unknown"
    return f"{config.path} ({config.head} head, {role}; {size})"


def _size(n: float) -> str:
    return f"{n / GB:.2f} GB" if n >= GB / 10 else f"{n / 1024**2:.1f} MB"


def _model_bytes(name: str, config, graph: Graph, batch: dict, pool: str) -> dict:
    """Bytes per part on `pool`: weights; grads and AdamW state if trained there; KV cache if
    it generates there."""
    arch = _architecture(config, graph.spec.base_dir)
    if not arch:
        return {}
    width = BYTES[config.dtype]
    out = {"weights": arch["params"] * width}
    spec = graph.spec
    modes = {d.mode for n, d in spec.nodes.items() if d.model == name and spec.pool_of(n) == pool}
    if "train" in modes:
        out["grads"] = arch["params"] * width
        out["optimizer"] = arch["params"] * 8  # AdamW's two fp32 moments
    if "rollout" in modes:
        new_tokens = max(
            (
                getattr(d.params, "max_new_tokens", 0)
                for d in graph.spec.nodes.values()
                if d.model == name
            ),
            default=0,
        )
        tokens = batch["rows"] * (graph.spec.data.max_prompt_len + new_tokens)
        out["kv_cache"] = tokens * arch["layers"] * 2 * arch["kv_dim"] * width
    return out


def _architecture(config: schema.ModelConfig, base_dir: Path) -> dict:
    known = schema.KNOWN_SIZES.get(config.path)
    if known:
        arch = dict(known)
    else:
        path = Path(config.path) if Path(config.path).is_absolute() else base_dir / config.path
        try:
            arch = _from_hf_config(json.loads((path / "config.json").read_text()))
        except (OSError, ValueError, KeyError):
            arch = {}
    if config.n_params:
        arch = {"layers": 0, "kv_dim": 0, **arch, "params": config.n_params}
    return arch


def _from_hf_config(c: dict) -> dict:
    hidden, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads = c["num_attention_heads"]
    kv_dim = hidden * c.get("num_key_value_heads", heads) // heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * c["intermediate_size"]
    embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings", False) else 2)
    return {"params": layers * per_layer + embeddings, "layers": layers, "kv_dim": kv_dim}


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
            if info["offload"] == "never":  # everything stays on the device for the whole run
                self.resident[pool] = {
                    (self.spec.nodes[n].model, part)
                    for n in self.calls_on[pool]
                    for part in NEEDS[self.spec.nodes[n].mode]
                }

    def _pool(self, node: str) -> str:
        return self.spec.pool_of(node)

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

    def _call(self, node: str, decl, preds: list[int]) -> None:
        pool, model, mode = self._pool(node), decl.model, decl.mode
        self._move(pool, "reload", {(model, p) for p in NEEDS[mode]} - self.resident[pool])
        workers = self.pools[pool]["workers"]
        how = decl.spec.dispatch
        dispatch = self.add(
            "dispatch",
            f"dispatch:{node}",
            preds,
            pool=pool,
            node=node,
            keys=decl.reads,
            how=how if workers > 1 else f"{how}, 1 rank",
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
            sync = self.add(
                "sync",
                f"sync:{model}",
                self.pool_deps(pool) + (self.pool_deps(to_pool) if to_pool else []),
                pool=pool,
                model=model,
                to_pool=to_pool,
                note="for the next step's generate",
            )
            if to_pool:  # the rollout pool is busy receiving until then
                self.last_on_pool[to_pool] = sync
        if self.pools[pool]["offload"] == "always":
            later = self.calls_on[pool][self.calls_on[pool].index(node) + 1 :]
            needed = set()
            if later:
                nxt = self.spec.nodes[later[0]]
                needed = {(nxt.model, p) for p in NEEDS[nxt.mode]}
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
