"""Helpers for tests of nodes and graphs: the tiny random model, and any graph run on it.

    from flowrl.testing import run_tiny

    def test_my_graph_trains(tmp_path):
        run = run_tiny("graphs/my_algo.toml", tmp_path)  # 2 steps, tiny model, no Ray
        assert run.metrics[-1]["update_policy/grad_norm"] > 0

The tokenizer and model behind `path = "tiny"` live in flowrl/models/tiny.py, since library code
loads them too; the overrides in flowrl/front/tiny_run.py. Library code must not import this module
(tests/unit/test_layout.py).
"""

import json
from pathlib import Path

import attrs

from flowrl.front.tiny_run import VARIED_SCORER, tiny_overrides
from flowrl.models.tiny import CHAT_TEMPLATE, SPECIAL, tiny_model, tiny_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL",
    "ScriptedTurns",
    "local_bytes",
    "VARIED_SCORER",
    "TinyRun",
    "on_ranks",
    "parameters",
    "rank_host",
    "rollout_parameters",
    "run_tiny",
    "tiny_model",
    "loss_params",
    "tiny_overrides",
    "tiny_plan",
    "tiny_tokenizer",
    "update_batch",
]


def tiny_plan(graph: str | Path, out_dir: str | Path, **extra):
    """The ExecutionPlan of `graph` on the tiny model (`tiny_overrides`), run dirs under
    `out_dir`; `extra` overrides as in `tiny_overrides`. Raises GraphErrors like `flowrl check`."""
    from flowrl.front.compiler import compile_file

    return compile_file(graph, tiny_overrides(graph, out_dir, **extra))


@attrs.frozen
class TinyRun:
    run_dir: Path
    metrics: list[dict]  # metrics.jsonl, one dict per logged row (step 0: validation)


def run_tiny(graph: str | Path, out_dir: str | Path, backend: str = "local", **extra) -> TinyRun:
    """Train `graph` on the tiny model (2 steps unless `"run.steps"` is given) and return its
    run directory and logged metrics. backend "local" runs every node in this process (no Ray).
    """
    from flowrl.runtime.controller import run

    run_dir = run(tiny_plan(graph, out_dir, **extra), backend=backend)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return TinyRun(run_dir, [json.loads(line) for line in lines])


def update_batch(b: int = 4, p: int = 5, t: int = 4, seed: int = 0):
    """A random DataProto an `update.policy` worker takes: b rows of p prompt tokens and
    responses of 1 to t tokens (right-padded), with advantages and old log-probs; ids in
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
    from flowrl.engines import sharding

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


def loss_params(**fields):
    """The params a policy loss of `flowrl.math.losses` reads, for calling one directly:
    update.policy's defaults overridden by `fields`, unvalidated (so e.g. CISPO's
    clip_low=None, no floor, can be tried)."""
    from types import SimpleNamespace

    from flowrl.nodes.update.policy import Params

    return SimpleNamespace(**(attrs.asdict(Params()) | fields))


class ScriptedTurns:
    """A turn backend (flowrl.agent.driver.TurnBackend) that samples nothing: request i's
    k-th turn is `script[i][k]` (a list of ids), cut to the turn's limit. It records what the
    driver appended before each turn (`appended[i]`) and the limits it asked for."""

    def __init__(self, script: dict, logprob: float = -0.5):
        self.script, self.logprob = script, logprob
        self.count = {i: 0 for i in script}
        self.appended = {i: [] for i in script}
        self.limits = {i: [] for i in script}

    def turn(self, rows, append, limits):
        out = []
        for i, extra, limit in zip(rows, append, limits, strict=True):
            self.appended[i].append(list(extra))
            self.limits[i].append(limit)
            ids = list(self.script[i][self.count[i]])[:limit]
            self.count[i] += 1
            out.append((ids, [self.logprob] * len(ids)))
        return out
