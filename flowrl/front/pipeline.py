"""`run.staleness = k > 0`: the step split into a rollout stage and a train stage, joined by a
bounded queue of batches (asynchronous, off-policy training; docs/scaling.md).

The rollout stage is every node placed on the rollout pool (generate) and every controller
node computed only from what that stage wrote (reward, advantage): it needs no trained model,
so it can run ahead. The train stage is the rest (reference / old log-probs, the updates).
The batch of step s is generated with the weights of update `version(s - 1, k, start)` =
max(s - 1 - k, start), `start` the steps done when the run started (0) or resumed; with
run.partial_rollout a round uses update `version(c, k, start)` = max(c - k, start), c the steps
with a full batch so far (runtime/partial.py): exactly k updates old once the pipeline is full,
never more, never fewer, so a run is reproducible whatever the timing. After update s the
trainer exports the weights; the rollout pool loads them just before it generates step
s + 1 + k. At most k batches wait in the queue.

The checks refuse what the pipeline cannot honour, naming the key and the fix. No torch here.
"""

import attrs

from flowrl.errors import Collector
from flowrl.hooks import TruncatedIS

FIX_POOLS = (
    'generate on a pool of its own: models.{model}.rollout_pool = "gen" with a [pools.gen] '
    "table, as graphs/grpo_disaggregated.toml does, or set run.staleness = 0"
)


def version(done: int, k: int, floor: int) -> int:
    """The update whose weights generate the next batch (or round) of the rollout stage, with
    `done` steps' batches assembled before it: k updates behind them, never older than `floor`
    (the weights the run started or resumed with). It reads counts only, never timing, so a
    run is reproducible and a resume continues it exactly; both the whole batches
    (flowrl/runtime/pipeline.py) and the rounds of partial rollouts (partial.py) use it."""
    return max(done - k, floor)


@attrs.frozen
class PipelinePlan:
    """The two stages of an asynchronous step, by node and by plan item."""

    staleness: int  # k: a batch comes from weights exactly min(k, s - 1) updates old
    model: str  # the trained model whose rollout copy generates
    rollout_pool: str
    train_pools: tuple[str, ...]
    rollout_nodes: tuple[str, ...]  # plan order
    train_nodes: tuple[str, ...]
    rollout_items: tuple[int, ...]  # item ids of the rollout stage's walk
    train_items: tuple[int, ...]  # item ids of the train stage's walk (without the sync)
    sync_item: int  # the cross-pool sync: run by the pipeline, not by either walk
    rows: int  # rows of a queued batch
    correction: str  # the off-policy correction the graph applies, in words ("" = none)
    partial: int = 0  # run.partial_rollout: tokens a response samples per round (0 = off)
    generate_items: tuple[int, ...] = ()  # partial rollouts: the rollout items of the round's
    # generate call (its dispatch, call, collect and the rollout pool's transitions) ...
    after_items: tuple[int, ...] = ()  # ... and the rest, run on the groups that finished
    generate_node: str = ""
    samples: int = 1  # the generate node's n
    max_new_tokens: int = 0  # the generate node's cap on a whole response
    logprobs: bool = False  # the generate node writes rollout_logprobs

    @property
    def queue_size(self) -> int:
        """The most batches that wait at once (the version rule allows no more)."""
        return max(self.staleness, 1)


def split(graph, items: list, rows: int, refill, errors: Collector, warnings: list):
    """The PipelinePlan of a graph with run.staleness > 0, or None when it is 0 (or refused:
    the problems go to `errors`)."""
    spec, k = graph.spec, graph.spec.run.staleness
    if not k:
        if spec.run.partial_rollout:
            errors.add(
                "[run]",
                f"partial_rollout = {spec.run.partial_rollout} continues unfinished responses "
                "in the next round on newer weights, which only the asynchronous pipeline runs",
                "set run.staleness = 1 (with a rollout pool of its own, as "
                "graphs/grpo_disaggregated.toml) or run.partial_rollout = 0",
            )
        return None
    rollout = [n for n in graph.order if spec.nodes[n].mode == "rollout"]
    if not rollout:
        errors.add("[run]", f"staleness = {k}, but no node generates", "set run.staleness = 0")
        return None
    model, gen = spec.nodes[rollout[0]].model, spec.pool_of(rollout[0])
    stage = _stages(graph, gen)
    sync = [i.id for i in items if i.kind == "sync" and i.model == model and i.to_pool]
    _refusals(graph, rollout[0], stage, refill, errors)
    if not sync and not errors.problems:
        errors.add(
            "[run]",
            f"staleness = {k}, but {model}, which [nodes.{rollout[0]}] generates with, is "
            "not trained: its samples can never be stale",
            "set run.staleness = 0",
        )
    if errors.problems:
        return None
    by_node = {n: s for s, nodes in stage.items() for n in nodes}
    in_stage = {s: tuple(i.id for i in items if _stage_of(i, by_node, gen) == s) for s in stage}
    correction = _correction(graph, model, stage["train"])
    if not correction:
        warnings.append(_no_correction(graph, model, k))
    partial = _partial(graph, rollout, items, in_stage["rollout"], errors)
    if errors.problems:
        return None
    return PipelinePlan(
        staleness=k,
        model=model,
        rollout_pool=gen,
        train_pools=tuple(sorted({p for n in stage["train"] if (p := spec.pool_of(n))})),
        rollout_nodes=tuple(stage["rollout"]),
        train_nodes=tuple(stage["train"]),
        rollout_items=in_stage["rollout"],
        train_items=tuple(i for i in in_stage["train"] if i != sync[0]),
        sync_item=sync[0],
        rows=rows,
        correction=correction,
        **partial,
    )


def _partial(graph, rollout: list[str], items: list, stage_items: tuple, errors) -> dict:
    """run.partial_rollout's fields of the PipelinePlan ({} when off); refuses what a round
    cannot continue: other than one rollout node whose spec declares how its responses
    continue (`NodeSpec.continues`, as `generate` does), a segment as long as the response
    cap."""
    spec, tokens = graph.spec, graph.spec.run.partial_rollout
    if not tokens:
        return {}
    node = rollout[0]
    decl = spec.nodes[node]
    if len(rollout) > 1 or decl.spec.continues is None:
        errors.add(
            "[run]",
            f"partial_rollout = {tokens} continues the responses of one rollout node that "
            'declares how (NodeSpec.continues, as `uses = "generate"` does); this graph '
            "generates with "
            + ", ".join(f'[nodes.{n}] (uses = "{spec.nodes[n].uses}")' for n in rollout),
            "set run.partial_rollout = 0, or give a node file of your own "
            '`continues=Continuation(...)` in its SPEC (docs/extending.md, "A node")',
        )
        return {}
    cap = decl.params.max_new_tokens
    if tokens >= cap:
        errors.add(
            "[run]",
            f"partial_rollout = {tokens} is not below nodes.{node}.max_new_tokens = {cap}: "
            "no response would ever be split across rounds",
            f"set run.partial_rollout below {cap} (e.g. {max(cap // 4, 1)}), or 0",
        )
        return {}
    by_id = {i.id: i for i in items}
    ours = tuple(  # the node's items and the transitions of its model on the rollout pool
        i
        for i in stage_items
        if by_id[i].node == node or (by_id[i].node is None and by_id[i].model == decl.model)
    )
    return {
        "partial": tokens,
        "generate_items": ours,
        "after_items": tuple(i for i in stage_items if i not in ours),
        "generate_node": node,
        "samples": decl.params.n,
        "max_new_tokens": cap,
        "logprobs": "rollout_logprobs" in decl.spec.writes_for(decl.params),
    }


def _refusals(graph, first_rollout: str, stage: dict, refill, errors: Collector) -> None:
    """What the pipeline cannot honour, each with its reason and fix."""
    spec, k = graph.spec, graph.spec.run.staleness
    model, gen = spec.nodes[first_rollout].model, spec.pool_of(first_rollout)
    trained = [n for n in graph.order if spec.nodes[n].mode == "train"]
    shared = [n for n in trained if spec.pool_of(n) == gen]
    if gen == spec.models[model].pool or shared:
        errors.add(
            "[run]",
            f"staleness = {k} runs generation and training at once, but "
            f"[nodes.{first_rollout}] generates on pool {gen}, where "
            f"{', '.join(shared) or model} trains (a colocated hybrid engine cannot do both "
            "at once)",
            FIX_POOLS.format(model=model),
        )
    if refill is not None and refill.groups:
        param = spec.nodes[refill.node].spec.refill.groups
        errors.add(
            "[run]",
            f"staleness = {k} cannot be combined with the refilling filter "
            f"[nodes.{refill.node}]: a refill generates again within the step until enough "
            "groups are kept, which the rollout stage running ahead cannot do",
            f"set run.staleness = 0, or {param} = 0 on [nodes.{refill.node}]",
        )
    if spec.run.critic_warmup:
        errors.add(
            "[run]",
            f"staleness = {k} cannot be combined with critic_warmup = {spec.run.critic_warmup}: "
            "during the warm-up the step runs a partial walk (the critic alone trains), which "
            "the pipelined train stage does not",
            "set run.critic_warmup = 0 or run.staleness = 0",
        )
    for node in stage["rollout"]:
        if any(p in stage["train"] for p in graph.dag.predecessors(node)):
            errors.add(
                f"[nodes.{node}]",
                f"runs on the rollout pool {gen} but reads what the train stage writes, so "
                f"run.staleness = {k} cannot run it ahead",
                "set run.staleness = 0",
            )


def _stages(graph, gen: str) -> dict[str, list[str]]:
    """Nodes by stage: on the rollout pool, or on the controller with every input from the
    rollout stage -> "rollout"; every other node -> "train". A stateful controller node stays
    in the train stage, so its state, like the weights, is that of the steps trained (what a
    checkpoint keeps)."""
    spec, out = graph.spec, {"rollout": [], "train": []}
    for node in graph.order:
        preds = list(graph.dag.predecessors(node))
        pool, stateful = spec.pool_of(node), spec.nodes[node].spec.stateful
        inputs_ahead = bool(preds) and all(p in out["rollout"] for p in preds)
        ahead = pool == gen or (pool is None and inputs_ahead and not stateful)
        out["rollout" if ahead else "train"].append(node)
    return out


def _stage_of(item, by_node: dict, gen: str) -> str:
    if item.node is not None:
        return by_node[item.node]
    return "rollout" if item.pool == gen else "train"  # reload / offload on a pool


def _correction(graph, model: str, train_nodes: list[str]) -> str:
    """How the updates of `model` account for samples from older weights, in words; "" when
    they do not (they take the trainer's own log-probs as the behaviour policy's). An update
    corrects through its node's `correction` hook, or by reading `old_logprobs` that the train
    stage recomputes."""
    spec, out = graph.spec, []
    for node in train_nodes:
        decl = spec.nodes[node]
        if decl.mode != "train" or decl.model != model:
            continue
        hook = decl.spec.correction
        words = hook(decl.params, decl.reads, node) if hook else ""
        if words:
            out.append(words)
            continue
        writer = graph.writers.get("old_logprobs")
        if "old_logprobs" in decl.reads and writer in train_nodes:
            out.append(f"old_logprobs recomputed on the trainer by {writer} before {node}")
            continue
        return ""
    return "; ".join(out)


def _no_correction(graph, model: str, k: int) -> str:
    """The warning for updates without a correction, with the ways the update's and the
    rollout node's declarations offer: a `TruncatedIS` hook's cap (with the switch that makes
    the rollout write rollout_logprobs), or old_logprobs recomputed by a logprob node (with
    the switch that makes the update read them)."""
    spec = graph.spec
    update = next(
        n for n in graph.order if spec.nodes[n].mode == "train" and spec.nodes[n].model == model
    )
    rollout = next(n for n in graph.order if spec.nodes[n].mode == "rollout")
    ways, tis = [], spec.nodes[update].spec.correction
    if isinstance(tis, TruncatedIS):
        switch = _switch(spec.nodes[rollout], "rollout_logprobs", "optional_writes")
        with_ = f" with nodes.{rollout}.{switch}" if switch else ""
        ways.append(
            f"set nodes.{update}.{tis.cap} (e.g. 2.0){with_} (truncated importance sampling)"
        )
    switch = _switch(spec.nodes[update], "old_logprobs", "optional_reads")
    if switch or "old_logprobs" in spec.nodes[update].reads:
        and_ = f" and nodes.{update}.{switch}" if switch else ""
        ways.append(f"recompute old_logprobs with a logprob node on {model}{and_}")
    fix = ", or ".join(ways) or "give its node a `correction` hook (docs/extending.md)"
    return (
        f"[run] staleness = {k}: [nodes.{update}] trains {model} on samples generated by weights "
        f"up to {k} update(s) old with no off-policy correction: {fix}"
    )


def _switch(decl, key: str, table: str) -> str:
    """The bool param that, flipped, makes the node read (table "optional_reads") or write
    ("optional_writes") `key`, as `name = value`; "" when none does or it already does."""
    wanted = getattr(decl.spec, table).get(key)
    if wanted is None or wanted(decl.params):
        return ""
    for field in attrs.fields(type(decl.params)):
        value = getattr(decl.params, field.name)
        flipped = {field.name: not value}
        if field.init and isinstance(value, bool) and wanted(attrs.evolve(decl.params, **flipped)):
            return f"{field.name} = {str(not value).lower()}"
    return ""
