"""An ExecutionPlan (flowrl/front/plan.py) as text (`flowrl plan`), JSON (`flowrl plan --json`)
and DOT (`flowrl render --plan`): every form a reader sees, the asynchronous pipeline's two
stages and queue included, written here and nowhere else. The records do not know their forms;
`ExecutionPlan.text`, `to_json` and `to_dot` call these functions.

Output is deterministic (the plan's own order; DOT edges sorted), so it can be compared to a
golden file. No torch or ray here.
"""

import json

import attrs
import networkx as nx

from flowrl.front.render import dot_escape, levels, rank_lines

# DOT node style of each item kind
STYLES = {
    "call": 'shape=box, style="filled", fillcolor="#cfe2f3"',
    "controller": 'shape=box, style="rounded,filled", fillcolor="#fff2cc"',
    "dispatch": 'shape=invhouse, style="filled", fillcolor="#d9ead3"',
    "collect": 'shape=house, style="filled", fillcolor="#d9ead3"',
    "reload": 'shape=hexagon, style="filled", fillcolor="#f4cccc"',
    "offload": 'shape=hexagon, style="filled,dashed", fillcolor="#ead1dc"',
    "sync": 'shape=doubleoctagon, style="filled", fillcolor="#fce5cd"',
}


# -- text ------------------------------------------------------------------------------------


def text(plan) -> str:
    """`flowrl plan`: pools, the batch, filters, the pipeline, the step's items, what may
    overlap, the warnings. `plan`: an ExecutionPlan."""
    lines = [f"plan for {plan.file}", "pools", *_pool_lines(plan)]
    b = plan.batch
    lines.append(f"batch: {b.prompts} prompts x {b.samples} samples = {b.rows} rows")
    lines += filter_lines(plan)
    if plan.pipeline:
        lines += pipeline_lines(plan.pipeline)
    if plan.after_warmup:
        lines.append(
            f"critic warm-up: {', '.join(plan.after_warmup)} skip steps 1-"
            f"{plan.spec.run.critic_warmup}; the other nodes run"
        )
    width = len(str(len(plan.items)))
    for title, items in _sections(plan):
        lines.append(title)
        for item in items:
            where = item.pool or "controller"
            after = f"  after {','.join(map(str, item.deps))}" if item.deps else ""
            lines.append(
                f"  {item.id:>{width}}  {item.kind:<10} {where:<10} {item.describe()}{after}"
            )
    lines += _overlap_lines(plan)
    lines.extend(f"warning: {w}" for w in plan.warnings)
    return "\n".join(lines) + "\n"


def _pool_lines(plan) -> list[str]:
    lines = []
    for name, pool in plan.pools.items():
        lines.append(
            f"  {name}: {pool.workers} worker(s) x {pool.device}, {pool.strategy}, "
            f"offload={pool.offload} ({pool.offload_reason}); sizes per rank"
        )
        if pool.machines > 1:
            where = "; ".join(
                f"node {k}: rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}"
                for k, r in enumerate(pool.ranks_by_node)
            )
            lines.append(f"    placement: {pool.placement} over {pool.machines} nodes ({where})")
        for model, info in pool.model_lines.items():
            lines.append(f"    {model}: {info}")
    return lines


def _overlap_lines(plan) -> list[str]:
    if not (plan.overlaps or plan.pipeline):
        return []
    lines = ["may overlap"]
    for name, others in plan.overlaps:
        lines.append(f"  {name} || {', '.join(others)}")
    if plan.pipeline:
        p = plan.pipeline
        ahead = "step s+1" if p.staleness == 1 else f"step s+1 .. s+{p.staleness}"
        ahead = "its rounds" if p.partial else ahead
        lines.append(
            f"  the rollout stage ({ahead}) || the train stage (step s): every "
            "item of one with every item of the other"
        )
    return lines


def filter_lines(plan) -> list[str]:
    """For each filter node: how it refills (if it does) and the rows the nodes after it
    receive (what it keeps: at most the rows it receives, or its refill's target)."""
    lines = []
    for node in plan.filters():
        after = plan.after(node)
        refill = plan.refill if plan.refill and plan.refill.node == node else None
        if refill and refill.groups:
            lines.append(refill_line(refill))
        if not after:
            continue
        rows, names = plan.batch.rows_per_node[after[0]], ", ".join(after)
        if refill and refill.groups:
            samples = rows // refill.groups
            lines.append(
                f"after {node}: {names} receive {refill.groups} groups x {samples} samples "
                f"= {rows} rows (fewer when the {refill.rounds} prompt batches run out)"
            )
        else:
            samples = rows // plan.batch.prompts
            lines.append(
                f"after {node}: {names} receive the rows {node} keeps: at most {rows} "
                f"({plan.batch.prompts} prompts x {samples} samples), varying by step"
            )
    return lines


def refill_line(refill) -> str:
    """A RefillPlan in words."""
    runs = ", ".join(refill.before)
    if not refill.groups:
        return f"filter: {refill.node} drops rows before {', '.join(refill.after)}"
    return (
        f"refill: {runs} run on up to {refill.rounds} prompt batches until {refill.node} "
        f"has kept {refill.groups} groups; then {', '.join(refill.after)} on those groups"
    )


# -- the asynchronous pipeline (run.staleness = k) in words ------------------------------------


def pipeline_lines(p) -> list[str]:
    """A PipelinePlan's summary: the version rule, the stages, the queue, the sync and the
    off-policy correction."""
    k = p.staleness
    if p.partial:
        return _partial_lines(p)
    return [
        f"async: run.staleness = {k}: step s trains on a batch generated with the weights "
        f"of update s-{k + 1} (the first {k + 1} steps: the initial weights)",
        f"  rollout stage on pool {p.rollout_pool}, runs up to {k} step(s) ahead: "
        + ", ".join(p.rollout_nodes),
        f"  queue: at most {p.queue_size} batch(es) of {p.rows} rows, every row "
        "stamped with weight_version",
        _train_line(p),
        f"  sync: after update s pool {p.train_pools[0]} exports {p.model}; "
        f"pool {p.rollout_pool} loads it before generating step s+{k + 1}",
        f"  off-policy correction: {p.correction or 'none'}",
    ]


def _train_line(p) -> str:
    return f"  train stage on pool {', '.join(p.train_pools)}: " + ", ".join(p.train_nodes)


def _partial_lines(p) -> list[str]:
    k, groups = p.staleness, p.rows // p.samples
    return [
        f"async: run.staleness = {k}, run.partial_rollout = {p.partial}: the rollout "
        f"stage runs in rounds; a round uses the weights of update c-{k}, c the steps with "
        "a full batch so far",
        f"  rollout stage on pool {p.rollout_pool}: each round {p.generate_node} "
        f"samples at most {p.partial} tokens of every response in flight (the next "
        "prompts and the unfinished responses, continued on the round's weights; every "
        "token stamped with its version, so a response continued over rounds keeps older "
        f"tokens); a group of {p.samples} is finished when its last response ends",
        f"  queue: the finished groups, in the order they finish; every {groups} make the "
        "batch of the next step, on which "
        + (", ".join(p.rollout_nodes[1:]) or "nothing more")
        + " run; batches wait for their step",
        _train_line(p),
        f"  sync: after update s pool {p.train_pools[0]} exports {p.model}; "
        f"pool {p.rollout_pool} loads it before the first round that uses it",
        f"  off-policy correction: {p.correction or 'none'}",
    ]


def _sections(plan) -> list[tuple[str, list]]:
    """The step's items under their headings: one list, or one per stage."""
    if not plan.pipeline:
        return [("step", list(plan.items))]
    p, by_id = plan.pipeline, {i.id: i for i in plan.items}
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


# -- JSON ------------------------------------------------------------------------------------


def to_json(plan) -> str:
    """`flowrl plan --json`: every record of the plan, keys sorted."""
    data = {
        "file": plan.file,
        "pools": {name: attrs.asdict(pool) for name, pool in plan.pools.items()},
        "batch": attrs.asdict(plan.batch),
        "validation": attrs.asdict(plan.validation),
        "refill": attrs.asdict(plan.refill) if plan.refill else None,
        "after_warmup": list(plan.after_warmup),
        "pipeline": attrs.asdict(plan.pipeline) if plan.pipeline else None,
        "items": [attrs.asdict(i) for i in plan.items],
        "overlaps": {name: list(others) for name, others in plan.overlaps},
        "warnings": list(plan.warnings),
    }
    return json.dumps(data, indent=2, sort_keys=True)


# -- DOT -------------------------------------------------------------------------------------


def to_dot(plan) -> str:
    """The plan as DOT, top to bottom in step order (each item one row below the last item
    it waits for): pool items in their pool's box, controller items in a box of their own;
    transitions and dispatch/collect styled. With a pipeline, the stages meet at a queue node
    and the weights go back as a dashed edge."""
    lines = ["digraph plan {", "  rankdir=TB; newrank=true;", '  node [fontname="Helvetica"];']
    lines += _box_lines(plan)
    dag = nx.DiGraph()
    dag.add_nodes_from(str(i.id) for i in plan.items)
    dag.add_edges_from((str(d), str(i.id)) for i in plan.items for d in i.deps)
    if plan.pipeline:  # the stages meet at the queue, not item to item
        dag = _through_queue(plan.pipeline, dag)
        lines += _queue_lines(plan.pipeline)
    lines += rank_lines(levels(dag))
    for a, b in sorted(dag.edges, key=lambda e: (_order(e[1]), _order(e[0]))):
        lines.append(f'  "{a}" -> "{b}";')
    if plan.pipeline:
        p = plan.pipeline
        first = p.rollout_items[0]
        lines.append(
            f'  "{p.sync_item}" -> "{first}" [style=dashed, constraint=false, '
            f'label="weights, loaded {p.staleness + 1} steps later"];'
        )
    lines.append("}")
    return "\n".join(lines) + "\n"


def _box_lines(plan) -> list[str]:
    """One cluster per pool (the controller's first), its items inside."""
    groups: dict[str | None, list] = {}
    for item in plan.items:
        groups.setdefault(item.pool, []).append(item)
    stage, lines = _stage_names(plan.pipeline), []
    for pool in sorted(groups, key=lambda p: (p is not None, p or "")):
        name, label = ("(controller)", "controller") if pool is None else (pool, f"pool {pool}")
        if pool in stage:
            label += f" ({stage[pool]} stage)"
        lines.append(f'  subgraph "cluster_{dot_escape(name)}" {{')
        lines.append(
            f'    label="{dot_escape(label)}"; style={"solid" if pool is None else "dashed"};'
        )
        for item in groups[pool]:
            words = f"{item.id}. {item.kind}\\n{dot_escape(item.describe())}"
            lines.append(f'    "{item.id}" [label="{words}", {STYLES[item.kind]}];')
        lines.append("  }")
    return lines


def _stage_names(p) -> dict:
    """Pool -> the stage it runs, for the DOT's box labels ({} when synchronous)."""
    if not p:
        return {}
    return {p.rollout_pool: "rollout"} | dict.fromkeys(p.train_pools, "train")


def _through_queue(p, dag: nx.DiGraph) -> nx.DiGraph:
    """The item DAG with every edge from the rollout stage to the train stage replaced
    by one through the queue node, and the sync's edge to the rollout pool dropped."""
    rollout = {str(i) for i in p.rollout_items}
    out = nx.DiGraph()
    out.add_nodes_from([*dag.nodes, "queue"])
    for a, b in dag.edges:
        if a in rollout and b not in rollout:
            out.add_edges_from([(a, "queue"), ("queue", b)])
        elif b not in rollout or a in rollout:
            out.add_edge(a, b)
    return out


def _queue_lines(p) -> list[str]:
    label = (
        f"queue\\nat most {p.queue_size} batch(es) of {p.rows} rows\\n"
        f"weights up to {p.staleness} update(s) old"
    )
    return [f'  "queue" [label="{label}", shape=cylinder, style="filled", fillcolor="#eeeeee"];']


def _order(name: str) -> tuple:
    """Sort key of a DOT node name: item ids in number order, the queue after them."""
    return (0, int(name)) if name.isdigit() else (1, 0)
