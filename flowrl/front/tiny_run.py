"""Any graph on the tiny random model: the overrides behind `flowrl run --tiny` and
`flowrl.testing.tiny_overrides`.

Every model's path becomes "tiny" (flowrl/models/tiny.py: a character-level tokenizer and a
2-layer Llama, built in milliseconds, no download); a step has 2 prompts and responses of at
most 6 tokens; 2 steps; validation on 4 prompts, at the start and the end; reward nodes score
by length (flowrl/rewards/varied.py), so the updates see nonzero advantages; a node's
`mini_batch_size` shrinks with the prompt batch, so an update keeps its number of optimizer
steps (at least the rows allow). Trainable models
get lr 0.01, so a test can see their parameters move; GPU pools and GPU-only rollout backends
fall back to CPU and flowrl's own decode loop. No torch or ray here.
"""

from pathlib import Path

import attrs

from flowrl.front import dsl

VARIED_SCORER = f"{Path(__file__).parents[1] / 'rewards' / 'varied.py'}:compute_score"
TINY_RUN = {
    "run.steps": 2,
    "run.val_size": 4,
    "run.val_every": 0,
    "data.batch_size": 2,
    "data.train_size": 64,
}
NODE_PARAMS = {"max_new_tokens": 6}  # set on every node that has the param


def tiny_overrides(graph, out_dir=None, scorer: str | None = VARIED_SCORER, **extra) -> list[str]:
    """Command-line overrides (`table.key=value`) that run `graph` on the tiny model.

    Args:
        graph: a graph file, or its parsed GraphSpec (`flowrl.front.dsl.load`).
        out_dir: where run directories go (run.out_dir); None keeps the graph's.
        scorer: the scorer of every node with a `scorer` param (reward.rule); None keeps the
            graph's.
        **extra: more overrides, `"run.steps": 5` or `"nodes.advantage.uses": '"my.py"'`; the
            value is written as TOML text, so strings need their quotes. They come last and win.
    """
    spec = dsl.load(graph) if isinstance(graph, str | Path) else graph
    out = [f'models.{name}.path="tiny"' for name in spec.models]
    out += [f"models.{name}.lr=0.01" for name, m in spec.models.items() if m.trainable]
    out += [f"{key}={value}" for key, value in TINY_RUN.items()]
    minis = tiny_mini_batches(spec)
    for node_id, decl in spec.nodes.items():
        fields = attrs.fields_dict(type(decl.params))
        out += [f"nodes.{node_id}.{p}={v}" for p, v in NODE_PARAMS.items() if p in fields]
        if node_id in minis:
            out.append(f"nodes.{node_id}.mini_batch_size={minis[node_id]}")
        if scorer is not None and "scorer" in fields:
            out.append(f'nodes.{node_id}.scorer="{scorer}"')
    if out_dir is not None:
        out.append(f'run.out_dir="{out_dir}"')
    declared_pools = spec.raw.get("pools", {})  # a graph without [pools] gets one by default
    out += [f"pools.{name}.cpus_per_worker=1" for name in declared_pools]
    out += cpu_fallback(spec)
    if spec.run.critic_warmup:  # of the 2 steps, the first warms the critic up
        out.append("run.critic_warmup=1")
    out += [f"{key}={value}" for key, value in extra.items()]
    return out


def tiny_mini_batches(spec) -> dict[str, int]:
    """node id -> its `mini_batch_size` scaled to the rows the node gets in the tiny run
    (rounded up), by the compiler's row arithmetic (flowrl/front/batching.py) at the graph's prompt
    batch and at the tiny one: after a refilling filter the rows are its target groups x
    samples, so they stay."""
    from flowrl.errors import Collector
    from flowrl.front import batching
    from flowrl.front.graph import build

    minis = {n: getattr(d.params, "mini_batch_size", 0) for n, d in spec.nodes.items()}
    minis = {n: m for n, m in minis.items() if m}
    if not minis:
        return {}
    graph, errors = build(spec), Collector(spec.file)
    refill = batching.refill_plan(graph, errors)
    full, _ = batching.node_rows(graph, refill, spec.data.batch_size)
    tiny, _ = batching.node_rows(graph, refill, TINY_RUN["data.batch_size"])
    return {node: max(1, -(-mini * tiny[node] // full[node])) for node, mini in minis.items()}


def cpu_fallback(spec) -> list[str]:
    """A GPU graph (e.g. graphs/grpo_sglang.toml) runs tiny on the CPU: its pools on "cpu" and
    flowrl's own decode loop in place of a GPU-only rollout backend, so its wiring is tried
    anywhere; tests/gpu/ runs such graphs as written where there is a GPU."""
    from flowrl.engines.rollout import DEVICE

    declared = spec.raw.get("pools", {})
    out = [
        f'pools.{n}.device="cpu"'
        for n, p in spec.pools.items()
        if p.device != "cpu" and n in declared
    ]
    out += [f'models.{n}.rollout="hf"' for n, m in spec.models.items() if m.rollout in DEVICE]
    return out
