"""Helpers for tests of nodes and graphs: the tiny random model, and any graph run on it.

    from flowrl.testing import run_tiny

    def test_my_graph_trains(tmp_path):
        run = run_tiny("graphs/my_algo.toml", tmp_path)  # 2 steps, tiny model, no Ray
        assert run.metrics[-1]["update_policy/grad_norm"] > 0

The tokenizer and model behind `path = "tiny"` live in flowrl/models/tiny.py, since library code
loads them too; the overrides in flowrl/front/tiny_run.py; one agent request on scripted turns
(`scripted_request`, `ScriptedTurns`) in flowrl/agent/scripted.py. Library code must not import
this module (tests/unit/test_layout.py).
"""

import json
from pathlib import Path

import attrs

from flowrl.agent.scripted import ScriptedTurns, scripted_request
from flowrl.front import registry
from flowrl.front.tiny_run import VARIED_SCORER, tiny_overrides
from flowrl.models.tiny import CHAT_TEMPLATE, SPECIAL, tiny_model, tiny_qwen2, tiny_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL",
    "ScriptedTurns",
    "TinyRun",
    "VARIED_SCORER",
    "assert_same",
    "check_sampler",
    "compile_text",
    "first_step",
    "graph_problems",
    "load_node",
    "load_ref",
    "local_bytes",
    "loss_params",
    "on_ranks",
    "parameters",
    "ragged_rows",
    "rank_host",
    "rollout_parameters",
    "run_tiny",
    "scripted_request",
    "tiny_engine",
    "tiny_model",
    "tiny_overrides",
    "tiny_plan",
    "tiny_qwen2",
    "tiny_tokenizer",
    "update_batch",
    "update_rows",
    "write_graph",
]


def tiny_plan(graph: str | Path, out_dir: str | Path, **extra):
    """The ExecutionPlan of `graph` on the tiny model (`tiny_overrides`), run dirs under
    `out_dir`; `extra` overrides as in `tiny_overrides`. Raises GraphErrors like `flowrl check`."""
    from flowrl.front.compiler import compile_file

    return compile_file(graph, tiny_overrides(graph, out_dir, **extra))


def write_graph(folder: str | Path, text: str, name: str = "g.toml", **fields) -> Path:
    """Write graph `text` to folder/name, with `{field}`s filled in (`text.format(**fields)`,
    so a literal brace is written doubled), and return its path."""
    path = Path(folder) / name
    path.write_text(text.format(**fields))
    return path


def compile_text(folder: str | Path, text: str, overrides=(), **fields):
    """The ExecutionPlan of graph `text` (written by `write_graph`) under `overrides`; raises
    GraphErrors like `flowrl check`."""
    from flowrl.front.compiler import compile_file

    return compile_file(write_graph(folder, text, **fields), list(overrides))


def graph_problems(folder: str | Path, text: str, overrides=(), **fields) -> list:
    """The problems (flowrl.errors.Problem) `flowrl check` finds in graph `text`; an
    AssertionError if it compiles."""
    from flowrl.errors import GraphErrors

    try:
        compile_text(folder, text, overrides, **fields)
    except GraphErrors as e:
        return e.problems
    raise AssertionError("the graph compiled; problems were expected")


@attrs.frozen
class TinyRun:
    run_dir: Path
    metrics: list[dict]  # metrics.jsonl, one dict per logged row (step 0: validation)
    summary: str = ""  # what was real and what was stubbed, as `flowrl run --tiny` prints it


def run_tiny(graph: str | Path, out_dir: str | Path, backend: str = "local", **extra) -> TinyRun:
    """Train `graph` on the tiny model (2 steps unless `"run.steps"` is given) and return its
    run directory and logged metrics. backend "local" runs every node in this process (no Ray).
    """
    from flowrl.front.tiny_run import summary
    from flowrl.runtime.controller import run

    plan = tiny_plan(graph, out_dir, **extra)
    run_dir = run(plan, backend=backend)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines]
    return TinyRun(run_dir, metrics, summary(plan.spec, metrics))


def update_batch(b: int = 4, p: int = 5, t: int = 4, seed: int = 0):
    """A random DataProto with every key an `update.policy` worker reads: b rows of p prompt
    tokens and responses of 1 to t tokens (right-padded), their response_mask and
    response_attention (the same: no tool output), advantages and old log-probs; ids in
    [3, 100), so they fit the tiny tokenizer's vocabulary."""
    import torch

    from flowrl.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    response_mask = torch.arange(t)[None] < torch.randint(1, t + 1, (b,), generator=g)[:, None]
    return DataProto.from_dict(
        {
            "prompts": torch.randint(3, 100, (b, p), generator=g),
            "prompt_mask": torch.ones(b, p, dtype=torch.long),
            "responses": torch.randint(3, 100, (b, t), generator=g) * response_mask,
            "response_mask": response_mask.long(),
            "response_attention": response_mask.long(),  # no tool output: as response_mask
            "advantages": torch.randn(b, 1, generator=g) * response_mask,
            "old_logprobs": torch.randn(b, t, generator=g) * 0.1 - 3.0,
        }
    )


# -- probes: what a test looks at inside a pool rank, run there by `on_ranks` -----------------
# (module-level functions of an installed module, so a Ray rank can unpickle them)


def on_ranks(executor, pool: str, probe, *args) -> list:
    """`probe(worker, *args)` on every rank of `pool`: each rank's result, in rank order."""
    return executor.apply(pool, probe, *args)


def parameters(worker, model: str) -> dict:
    """The model's whole parameters as CPU tensors; under fsdp a collective (every rank)."""
    engine = worker.train[model]
    return engine.sharding.full_state(engine.module, worker.rank, everywhere=True)


def rollout_parameters(worker, model: str) -> dict:
    """The weights the rollout engine of `model` generates from, as CPU tensors."""
    module = worker.rollout_copies.get(model, worker.train[model].module)
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def local_bytes(worker, model: str) -> dict:
    """Bytes of `model` the rank holds: {"weights", "optimizer"} (its shards under fsdp)."""
    from flowrl.engines.train import sharding

    return sharding.local_bytes(worker.train[model])


def rank_host(worker) -> dict:
    """Where the rank runs: Ray node id (under Ray), host and process id."""
    import os
    import socket

    node = ""
    try:
        import ray

        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
    return {"node_id": node, "host": socket.gethostname(), "pid": os.getpid()}


def ragged_rows(seed: int = 0, b: int = 4, p: int = 6, t: int = 5):
    """A random DataProto of b left-padded prompts (2 to p tokens) and right-padded responses
    (1 to t tokens), with their masks; ids in [3, 100)."""
    import torch

    from flowrl.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(2, p + 1, (b,), generator=g)
    resp_len = torch.randint(1, t + 1, (b,), generator=g)
    prompt_mask = (torch.arange(p)[None] >= p - prompt_len[:, None]).long()
    response_mask = (torch.arange(t)[None] < resp_len[:, None]).long()
    return DataProto.from_dict(
        {
            "prompts": torch.randint(3, 100, (b, p), generator=g) * prompt_mask,
            "prompt_mask": prompt_mask,
            "responses": torch.randint(3, 100, (b, t), generator=g) * response_mask,
            "response_mask": response_mask,
        }
    )


def update_rows(b: int = 6, p: int = 5, t: int = 4, seed: int = 0):
    """A random DataProto that the policy and the critic update take: b rows of p prompt
    tokens and responses of 1 to t tokens (right-padded), advantages zero on every second row
    (rows without a gradient, which an update may skip), old log-probs, values and returns;
    ids in [3, 100), within the tiny tokenizer's vocabulary."""
    import torch

    from flowrl.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    response_mask = torch.arange(t)[None] < torch.randint(1, t + 1, (b,), generator=g)[:, None]
    advantages = torch.randn(b, 1, generator=g) * response_mask
    advantages[::2] = 0.0  # half the rows carry no signal
    return DataProto.from_dict(
        {
            "prompts": torch.randint(3, 100, (b, p), generator=g),
            "prompt_mask": torch.ones(b, p, dtype=torch.long),
            "responses": torch.randint(3, 100, (b, t), generator=g) * response_mask,
            "response_mask": response_mask.long(),
            "advantages": advantages,
            "old_logprobs": torch.randn(b, t, generator=g) * 0.1 - 3.0,
            "values": torch.zeros(b, t),
            "returns": torch.randn(b, t, generator=g),
        }
    )


def first_step(model, worker_class, params, micro_tokens: int = 4096, rows=None):
    """(the gradients of the first optimizer step, the metrics) of `worker_class(engine,
    params)` run on `rows` (default `update_rows()`), over a copy of `model` (lr 0.01)."""
    import copy

    from flowrl.engines import TrainEngine

    engine = TrainEngine(copy.deepcopy(model), tiny_tokenizer(), lr=1e-2, micro_tokens=micro_tokens)
    grads, step = [], engine.step

    def record_then_step():
        grads.append(
            {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}
        )
        return step()

    engine.step = record_then_step
    _, metrics = worker_class(engine, params)(update_rows() if rows is None else rows)
    return grads[0], metrics


def assert_same(a: dict, b: dict) -> None:
    """Two dicts of tensors (gradients by parameter name) hold the same keys and values, up to
    float32 summation order."""
    import torch

    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-7)


def tiny_engine(head: str = "lm", lr: float = 1e-2, seed: int = 0, **kwargs):
    """A `TrainEngine` (flowrl/engines/train/engine.py) on `tiny_model(head, seed)` and the tiny
    tokenizer, one rank, no Ray: what an update or logprob node's worker receives as `engine`.
    `kwargs` go to TrainEngine (`micro_tokens`, `grad_clip`, `trainable`, ...)."""
    from flowrl.engines import TrainEngine

    return TrainEngine(tiny_model(head=head, seed=seed), tiny_tokenizer(), lr=lr, **kwargs)


def load_node(uses: str | Path):
    """The module of a node: a node file's path (imported as a graph's `uses` imports it, so
    its sibling modules import too) or a built-in name ("reward.rule"): its `SPEC`, `Params`,
    pure functions and worker."""
    from flowrl.front import registry

    if str(uses).endswith(".py"):
        return registry.node_module(str(Path(uses).resolve()))
    return registry.node_module(str(uses))


def load_ref(ref: str, base_dir: str | Path = "."):
    """The object a graph-file reference names, as the graph resolves it: "file.py:name"
    (relative to base_dir) or "package.module:name": a tool, parser, scorer or interaction."""
    from flowrl import refs

    return refs.load(ref, base_dir, what="reference")


def loss_params(**fields):
    """The params a policy loss of `flowrl.math.losses` reads, for calling one directly:
    update.policy's defaults overridden by `fields`, unvalidated (so e.g. CISPO's
    clip_low=None, no floor, can be tried)."""
    from types import SimpleNamespace

    # the built-in node's params, found as a graph finds them (nodes/ import flowrl, not back)
    Params = registry.resolve("update.policy").spec.params
    return SimpleNamespace(**(attrs.asdict(Params()) | fields))


def try_loss(loss: str, base_dir: str | Path = ".", options: dict | None = None, **fields):
    """A policy loss taken as `update.policy` takes it: `loss`, a built-in name or a reference
    ("my_losses.py:TOPR", relative to base_dir), loaded and checked as `flowrl check` checks it
    (with `options`, the update node's `loss_options` table), then called once on
    `update_rows()` (log-probs that carry a gradient, the node's params overridden by `fields`,
    the loss's first state) and its return value checked as every call's is; a loss with
    `after_update` then makes its next state from the rates, checked too. Returns (the scalar
    loss, its rates as floats); raises `ComponentError` (or `StateError`) naming the function's
    file:line and the fix."""
    from types import MappingProxyType

    from flowrl.math import components
    from flowrl.math.losses import Chunk

    Params = registry.resolve("update.policy").spec.params

    record = components.resolve_loss(loss, base_dir)
    for problem in components.loss_problems(record, loss, Params, "update.policy"):
        raise problem
    built = components.loss_options(record, loss, options or {}, "update_policy")
    state = components.first_state(record, loss, built)
    rows = update_rows()
    old = rows["old_logprobs"]
    logprobs = (old + 0.1 * old.sign()).requires_grad_()  # (b, t): a step away from the old
    args = (logprobs, old, rows["advantages"], rows["response_mask"], loss_params(**fields))
    chunk = Chunk(options=built, state=MappingProxyType(state))
    value, rates = components.checked_loss(record, loss, record.fn(*args, chunk))
    components.next_state(record, loss, state, rates, built)
    return value, rates


def check_sampler(sampler_class, size: int = 20, options=None, batch_size: int = 4, steps=6):
    """Check a data sampler (flowrl/samplers.py's protocol) the way a run relies on it:
    drawing `steps` batches of `batch_size` from `size` prompts, told made-up scores after each
    (prompt i passes when i is even), it draws `batch_size` integers in range and its state is
    plain JSON (else `SamplerError`, the run's own message: `flowrl.samplers.checked_draw`),
    two samplers of the same seed draw alike, and one restored from the state after half the
    steps draws what the first drew next (else AssertionError saying what failed). Returns the
    draws."""
    from flowrl.errors import unstorable
    from flowrl.samplers import SamplerError, checked_draw

    options = sampler_class.Options() if options is None else options

    def drawn(sampler, first: int, last: int) -> list[list[int]]:
        out = []
        for step in range(first, last + 1):
            picked = checked_draw(sampler, sampler.next(batch_size), batch_size, size)
            sampler.update(picked, [float(i % 2 == 0) for i in picked], step)
            out.append(picked)
        if problem := unstorable(sampler.state_dict()):
            raise SamplerError(
                f"{sampler_class.__name__}.state_dict() returned {problem}",
                "a checkpoint (JSON) cannot store it: return numbers, strings, lists and dicts "
                "with string keys",
            )
        return out

    first = sampler_class(size, 0, options)
    draws = drawn(first, 1, steps)
    again = drawn(sampler_class(size, 0, options), 1, steps)
    assert draws == again, "two samplers of the same seed and results drew differently"
    half = steps // 2
    paused = sampler_class(size, 0, options)
    drawn(paused, 1, half)
    state = json.loads(json.dumps(paused.state_dict()))  # what a checkpoint stores
    resumed = sampler_class(size, 0, options)
    resumed.load_state_dict(state)
    assert drawn(resumed, half + 1, steps) == draws[half:], "a restored sampler drew otherwise"
    return draws
