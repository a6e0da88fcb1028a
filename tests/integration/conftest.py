"""Run shipped graphs on tiny random models, a few steps, no download."""

from pathlib import Path

import pytest

from flowrl.cli import load_plan

ROOT = Path(__file__).resolve().parents[2]
SCORER = Path(__file__).with_name("varied_scorer.py")


def tiny_overrides(graph: str, tmp_path, **extra) -> list[str]:
    from flowrl import dsl

    spec = dsl.load(ROOT / "graphs" / graph)
    out = [f'models.{name}.path="tiny"' for name in spec.models]
    out += [f"models.{name}.lr=0.01" for name, m in spec.models.items() if m.trainable]
    out += [
        "run.steps=2",
        "run.val_size=4",
        "run.val_every=0",
        "data.batch_size=2",
        "data.train_size=64",
        f'run.out_dir="{tmp_path}"',
    ]
    for node, decl in spec.nodes.items():  # every rollout and rule reward (ReMax has two)
        if decl.uses == "generate":
            out.append(f"nodes.{node}.max_new_tokens=6")
        if decl.uses == "reward.rule":
            out.append(f'nodes.{node}.scorer="{SCORER}:compute_score"')
    out += [f"pools.{name}.cpus_per_worker=1" for name in spec.pools]
    out += cpu_fallback(spec)
    out += [f"{k}={v}" for k, v in extra.items()]
    return out


def cpu_fallback(spec) -> list[str]:
    """A GPU graph (graphs/grpo_sglang.toml) trains here on CPU, with flowrl's decode loop in
    place of its GPU-only rollout backend, so its wiring is tested on every run;
    tests/gpu/test_sglang.py runs it as written where there is a GPU and SGLang."""
    from flowrl.engines.rollout import DEVICE

    out = [f'pools.{name}.device="cpu"' for name, p in spec.pools.items() if p.device != "cpu"]
    out += [f'models.{name}.rollout="hf"' for name, m in spec.models.items() if m.rollout in DEVICE]
    return out


@pytest.fixture
def tiny_plan(tmp_path):
    def make(graph: str, **extra):
        return load_plan(str(ROOT / "graphs" / graph), tiny_overrides(graph, tmp_path, **extra))

    return make
