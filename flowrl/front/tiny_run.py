"""Any graph on the tiny random model: the overrides behind `flowrl run --tiny` and
`flowrl.testing.tiny_overrides`.

Every model's path becomes "tiny" (flowrl/models/tiny.py: a character-level tokenizer and a
2-layer Llama, built in milliseconds, no download); a step has 2 prompts and responses of at
most 6 tokens; 2 steps; validation on 4 prompts, at the start and the end; data.max_prompt_len
four times the graph's (the tiny tokenizer spends a token per character); reward nodes score by
length (flowrl/rewards/varied.py), so the updates see nonzero advantages; a node's mini-batch
size shrinks with the prompt batch, so an update keeps its number of optimizer steps (at least
the rows allow); an agent node's first turn calls each of its tools (so the tools run: a random
policy never calls one), and its interactions get room to answer two turns. Trainable models
get lr 0.01, so a test can see their parameters move; GPU pools and GPU-only rollout backends
fall back to CPU and flowrl's own decode loop. Node params are found through the node's hooks,
whatever they are called: rollout nodes' `RolloutParams`, the `MiniBatches` declaration of an
update, a reward node's `scorer_param`, and a node's own `tiny` hook (the agent's scripted
turn, a reward model's stub, as `hooks.TinyNode`). No torch or ray here.
"""

from pathlib import Path

from flowrl.backends import ROLLOUT_BACKENDS
from flowrl.front import dsl
from flowrl.front.typed_toml import toml_value
from flowrl.hooks import TinyNode
from flowrl.nodespec import RolloutParams

VARIED_SCORER = f"{Path(__file__).parents[1] / 'rewards' / 'varied.py'}:compute_score"
TINY_RUN = {
    "run.steps": 2,
    "run.val_size": 4,
    "run.val_every": 0,
    "data.batch_size": 2,
    "data.train_size": 64,
}
MAX_NEW_TOKENS = 6  # on every rollout node (RolloutParams.max_new_tokens)
# The tiny tokenizer spends one token per character where a real one spends about one per
# four, so a prompt that fits the graph's data.max_prompt_len in its own model's tokens (a chat
# template's tool block included) is four times as long on the tiny model: without room for
# it every row is dropped. The tiny Llama's RoPE has no position table to outgrow.
CHARS_PER_TOKEN = 4


def tiny_overrides(graph, out_dir=None, scorer: str | None = VARIED_SCORER, **extra) -> list[str]:
    """Command-line overrides (`table.key=value`) that run `graph` on the tiny model.

    Args:
        graph: a graph file, or its parsed GraphSpec (`flowrl.front.dsl.load`).
        out_dir: where run directories go (run.out_dir); None keeps the graph's.
        scorer: the scorer of every node that declares a `scorer_param` (reward.rule); None
            keeps the graph's.
        **extra: more overrides, `"run.steps": 5` or `"nodes.advantage.uses": '"my.py"'`; the
            value is written as TOML text, so strings need their quotes. They come last and win.
    """
    spec = dsl.load(graph) if isinstance(graph, str | Path) else graph
    out = [f'models.{name}.path="tiny"' for name in spec.models]
    out += [f"models.{name}.lr=0.01" for name, m in spec.models.items() if m.trainable]
    out += [f"{key}={value}" for key, value in TINY_RUN.items() if key != "run.val_size"]
    # a graph's own smaller validation (0: off) stays: its data may hold fewer rows
    out.append(f"run.val_size={min(TINY_RUN['run.val_size'], spec.run.val_size)}")
    out.append(f"data.max_prompt_len={CHARS_PER_TOKEN * spec.data.max_prompt_len}")
    minis = tiny_mini_batches(spec)
    for node_id, decl in spec.nodes.items():
        if isinstance(decl.params, RolloutParams):
            out.append(f"nodes.{node_id}.max_new_tokens={MAX_NEW_TOKENS}")
        if node_id in minis:
            out.append(f"nodes.{node_id}.{decl.spec.mini_batches.size}={minis[node_id]}")
        if scorer is not None and decl.spec.scorer_param:
            out.append(f'nodes.{node_id}.{decl.spec.scorer_param}="{scorer}"')
    out += node_overrides(spec)
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
    """node id -> its mini-batch size (the param its `MiniBatches` names) scaled to the rows
    the node gets in the tiny run (rounded up), by the compiler's row arithmetic
    (flowrl/front/batching.py) at the graph's prompt batch and at the tiny one: after a
    refilling filter the rows are its target groups x samples, so they stay."""
    from flowrl.errors import Collector
    from flowrl.front import batching
    from flowrl.front.graph import build

    minis = {
        n: getattr(d.params, d.spec.mini_batches.size)
        for n, d in spec.nodes.items()
        if d.spec.mini_batches is not None
    }
    minis = {n: m for n, m in minis.items() if m}
    if not minis:
        return {}
    graph, errors = build(spec), Collector(spec.file)
    refill = batching.refill_plan(graph, errors)
    full, _ = batching.node_rows(graph, refill, spec.data.batch_size)
    tiny, _ = batching.node_rows(graph, refill, TINY_RUN["data.batch_size"])
    return {node: max(1, -(-mini * tiny[node] // full[node])) for node, mini in minis.items()}


def node_overrides(spec) -> list[str]:
    """What each node's `tiny` hook sets on it (e.g. the agent node's first turn calling each
    of its tools, with a budget that fits the turn: nodes/agent.py `tiny`)."""
    out = []
    for node_id, decl in spec.nodes.items():
        part = _tiny(decl, spec.base_dir)
        out += [f"nodes.{node_id}.{k}={toml_value(v)}" for k, v in part.params.items()]
    return out


def _tiny(decl, base_dir) -> TinyNode:
    return decl.spec.tiny(decl.params, str(base_dir)) if decl.spec.tiny else TinyNode()


def cpu_fallback(spec) -> list[str]:
    """A GPU graph (e.g. graphs/grpo_sglang.toml) runs tiny on the CPU: its pools on "cpu" and
    flowrl's own decode loop in place of a GPU-only rollout backend, so its wiring is tried
    anywhere; tests/gpu/ runs such graphs as written where there is a GPU."""
    declared = spec.raw.get("pools", {})
    out = [
        f'pools.{n}.device="cpu"'
        for n, p in spec.pools.items()
        if p.device != "cpu" and n in declared
    ]
    out += [f'models.{n}.rollout="hf"' for n, m in spec.models.items() if _device_bound(m.rollout)]
    return out


def _device_bound(name: str) -> bool:
    """A backend of the table that runs on one device kind only (a tiny run is on the CPU)."""
    record = ROLLOUT_BACKENDS.get(name)
    return bool(record and record.device)


def summary(spec, metrics: list[dict]) -> str:
    """What a tiny run exercised for real and what it stubbed, from the plan's spec (the tiny
    overrides applied) and the run's metrics.jsonl rows; `flowrl run --tiny` prints it last."""
    lines = ["tiny run: what was real and what was stubbed"]
    models = ", ".join(spec.models)
    lines.append(
        f'  stubbed  model weights: {models} on path = "tiny" (random 2-layer Llama, '
        "character tokenizer): what they generate and score means nothing"
    )
    for node_id, decl in spec.nodes.items():
        param = decl.spec.scorer_param
        scorer = getattr(decl.params, param) if param else None
        if scorer == VARIED_SCORER:
            lines.append(f"  stubbed  scorer of [nodes.{node_id}]: by response length (varied.py)")
        elif scorer is not None:
            lines.append(f"  real     scorer of [nodes.{node_id}]: {scorer}")
        part = _tiny(decl, spec.base_dir)
        if decl.model and part.model_role:
            lines.append(
                f"  stubbed  {part.model_role} of [nodes.{node_id}]: {decl.model}, random weights"
            )
        lines += _tool_lines(node_id, part, metrics)
        lines += _interaction_lines(node_id, part, metrics)
        lines += [
            f"  real     {what} of [nodes.{node_id}]: {ref}" for what, ref in part.real.items()
        ]
    source = spec.data.source
    lines.append(f"  real     data: {source} ({spec.data.batch_size} prompts per step)")
    if spec.run.val_size:
        lines.append(
            f"  stubbed  validation: {spec.run.val_size} prompts on the random model (and an "
            "agent's scripted first turn): its score means nothing"
        )
    lines.append("  real     node code, the plan, the executor, checkpoints and metrics")
    return "\n".join(lines)


def _tool_lines(node_id: str, part: TinyNode, metrics: list[dict]) -> list[str]:
    """One line per tool of a node: calls and answered calls per request, by step."""
    how = "first turn scripted, placeholder arguments" if part.scripted else "policy's own calls"
    out = []
    for name in part.tools:
        key = f"{node_id}/calls/{name}"
        rows = [m for m in metrics if key in m]  # the training steps (validation has none)
        calls, ok = [m[key] for m in rows], [m.get(f"{key}/ok", 0.0) for m in rows]
        if not calls:
            out.append(f"  NOT RUN  tool {name} of [nodes.{node_id}]: never called ({how})")
            continue
        mean, answered = sum(calls) / len(calls), sum(ok) / len(ok)
        out.append(
            f"  real     tool {name} of [nodes.{node_id}]: {mean:.2f} calls per request, "
            f"{answered:.2f} answered ({how})"
        )
    return out


def _interaction_lines(node_id: str, part: TinyNode, metrics: list[dict]) -> list[str]:
    """One line per interaction of a node, from every source (a function, a verl class, a
    verl YAML's entries): its replies per request, by step."""
    out = []
    for name, source in part.interactions.items():
        key = f"{node_id}/interactions/{name}"
        replies = [m[key] for m in metrics if key in m]  # the training steps with its rows
        if not any(replies):
            out.append(
                f"  NOT RUN  interaction {name} of [nodes.{node_id}]: never answered ({source})"
            )
            continue
        mean = sum(replies) / len(replies)
        out.append(
            f"  real     interaction {name} of [nodes.{node_id}]: {mean:.2f} replies per "
            f"request, to the random policy's cut turns ({source})"
        )
    return out
