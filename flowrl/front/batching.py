"""Pass 1 of the compiler (flowrl/front/compiler.py): the batch arithmetic of one step. How many
rows each node receives (prompts x the samples of the rollout nodes above it, or a refilling
filter's target groups after it), each node's checks against those rows, which filter refills
the step, and which train nodes wait out the critic warm-up. No torch, no ray.
"""

import attrs
import networkx as nx

from flowrl.errors import Collector, did_you_mean, one_of
from flowrl.front.graph import Graph
from flowrl.front.plan import BatchPlan, RefillPlan
from flowrl.hooks import CheckContext


def refill_plan(graph: Graph, errors: Collector) -> RefillPlan | None:
    """The plan of the filter node that refills its step (a `refill` hook), if any: the nodes
    each prompt batch runs (its ancestors and itself) and those that run once after it."""
    spec = graph.spec
    filters = [n for n in graph.order if spec.nodes[n].spec.refill is not None]
    for extra in filters[1:]:
        errors.add(
            f"[nodes.{extra}]",
            f"a step refills through one filter node, and [nodes.{filters[0]}] already does",
            f"keep one filter with a refill ({spec.nodes[extra].spec.refill.groups}), or chain "
            "the conditions in one node",
        )
    if not filters:
        return None
    node = filters[0]
    decl = spec.nodes[node]
    groups, rounds = decl.spec.refill.of(decl.params)
    ancestors = nx.ancestors(graph.dag, node)
    before = tuple(n for n in graph.order if n in ancestors or n == node)
    after = tuple(n for n in graph.order if n not in before)
    return RefillPlan(node, groups, max(rounds, 1), before, after)


def node_rows(graph: Graph, refill, prompts: int) -> tuple[dict[str, int], dict[str, int]]:
    """node id -> the rows it receives from a batch of `prompts` prompts, and node id -> the
    samples per prompt upstream of and including it."""
    spec = graph.spec
    rows, samples = {}, {}
    expanders = [n for n, d in spec.nodes.items() if d.spec.rows == "repeat" and d.params.n > 1]
    kept = set(refill.after) if refill and refill.groups else set()
    for node in graph.order:  # row edges order every node against each expander
        ancestors = nx.ancestors(graph.dag, node)
        n = 1
        for expander in expanders:
            if expander in ancestors:
                n *= spec.nodes[expander].params.n
        # after a refilling filter, at most its target groups remain
        rows[node] = (refill.groups if node in kept else prompts) * n
        samples[node] = n
    return rows, samples


def unwired_findings(spec, errors: Collector) -> None:
    """The nodes' own check hooks for a graph that could not be wired (so its errors come with
    the wiring's): each node receives the prompts times the samples of the rollout nodes above
    it in the file, which is what the row edges make of a graph. Errors only."""
    prompts, n = spec.data.batch_size, 1
    for node, decl in spec.nodes.items():
        workers = spec.pools[spec.pool_of(node)].workers if decl.model else 1
        model_path = spec.models[decl.model].path if decl.model in spec.models else ""
        context = CheckContext(
            node, prompts * n, n, prompts, workers, str(spec.base_dir), model_path
        )
        for finding in decl.spec.findings(decl.params, context):
            if not finding.warning:
                errors.add(f"[nodes.{node}]", finding.message, finding.fix)
        if decl.spec.rows == "repeat":
            n *= decl.params.n


def batch_plan(graph: Graph, refill, errors: Collector) -> tuple[BatchPlan, list[str]]:
    """Rows, groups and samples per node; every node's own checks (mini-batches vs rows, ...)
    against them. Returns the batch plan and the warnings; errors go to `errors`."""
    spec, warnings = graph.spec, []
    prompts = spec.data.batch_size
    rows, samples = node_rows(graph, refill, prompts)
    rollout = [d.model for d in spec.nodes.values() if d.mode == "rollout"] + list(spec.models)
    policy = spec.models[rollout[0]].path if rollout and rollout[0] in spec.models else ""
    for node, decl in spec.nodes.items():
        where = f"[nodes.{node}]"
        if decl.spec.groups and samples[node] < 2:
            errors.add(
                where,
                f"{decl.uses} compares the samples of each prompt, but each prompt "
                "has 1 sample here",
                "set n >= 2 on the generate node before it",
            )
        workers = spec.pools[spec.pool_of(node)].workers if decl.model else 1
        model_path = spec.models[decl.model].path if decl.model in spec.models else ""
        sources = tuple(s for s in (spec.data.source, spec.data.val_source) if s)
        context = CheckContext(
            node, rows[node], samples[node], prompts, workers, str(spec.base_dir), model_path
        )
        context = attrs.evolve(context, data_sources=sources, policy_path=policy)
        for finding in decl.spec.findings(decl.params, context):
            if finding.warning:
                warnings.append(finding.message)
            else:
                errors.add(where, finding.message, finding.fix)
        if decl.model and rows[node] < workers:
            warnings.append(
                f"{where} gives {rows[node]} rows to {workers} ranks: some ranks "
                "idle (raise data.batch_size or lower the pool's workers)"
            )
    total = max(rows.values(), default=prompts)
    return BatchPlan(prompts, max(samples.values(), default=1), total, rows), warnings


def check_save_inputs(graph: Graph, errors: Collector) -> None:
    """run.save_inputs names nodes of the graph (one the graph skips is allowed: it never runs)."""
    known = set(graph.spec.nodes) | set(graph.pruned)
    for node in graph.spec.run.save_inputs:
        if node not in known:
            errors.add(
                "[run]",
                f'save_inputs names "{node}", which is not a node{did_you_mean(node, known)}',
                f"name nodes of this graph: {one_of(sorted(known))}",
            )


def after_warmup_nodes(graph: Graph, refill, errors: Collector) -> tuple[str, ...]:
    """The train nodes that wait out run.critic_warmup: those of models without a value head."""
    spec = graph.spec
    if not spec.run.critic_warmup:
        return ()
    train = [n for n in graph.order if spec.nodes[n].mode == "train"]
    critics = [n for n in train if spec.models[spec.nodes[n].model].head == "value"]
    where = f"critic_warmup = {spec.run.critic_warmup}"
    if not critics:
        errors.add(
            "[run]",
            f"critic_warmup = {spec.run.critic_warmup}, but no train node updates a value-head "
            "model, so there is no critic to warm up",
            'add a critic (a model with head = "value" and an update.critic node) or set '
            "critic_warmup = 0",
        )
    elif spec.run.critic_warmup >= spec.run.steps:
        errors.add(
            "[run]",
            f"{where} leaves none of the run's {spec.run.steps} steps to "
            f"{', '.join(n for n in train if n not in critics)}",
            "set critic_warmup below run.steps",
        )
    elif refill is not None:
        errors.add(
            "[run]",
            f"{where} cannot be combined with the refilling filter [nodes.{refill.node}]",
            f"set critic_warmup = 0, or {spec.nodes[refill.node].spec.refill.groups} = 0 on "
            f"[nodes.{refill.node}]",
        )
    return tuple(n for n in train if n not in critics)
