"""Every shipped graph trains a few steps on tiny models, with both executors."""

import json
from pathlib import Path

import pytest
import torch

from flowrl.runtime.controller import Trainer
from flowrl.testing import on_ranks, parameters

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = sorted(p.name for p in (ROOT / "graphs").glob("*.toml"))


def params_of(trainer, model):
    return on_ranks(trainer.executor, trainer.spec.models[model].pool, parameters, model)[0]


def train(plan, tmp_path, backend):
    trainer = Trainer(plan, tmp_path / "run", backend)
    before = {m: params_of(trainer, m) for m in plan.spec.models}
    trainer.fit()
    after = {m: params_of(trainer, m) for m in plan.spec.models}
    return trainer, before, after


def shift_invariant(spec, name: str) -> set[str]:
    """Parameters whose gradient is 0 by design: the Bradley-Terry loss reads only score
    differences, so without its centring term a reward model's head bias never moves."""
    return {
        "value_head.bias"
        for node in spec.nodes.values()
        if node.uses == "update.reward_model" and node.model == name and not node.params.center
    }


def check_parameters(spec, before, after):
    for name, model in spec.models.items():
        fixed = shift_invariant(spec, name)
        for key, value in before[name].items():
            changed = not torch.equal(value, after[name][key])
            expected = model.trainable and key not in fixed
            assert changed == expected, f"{name}.{key} changed={changed}"


@pytest.mark.parametrize("graph", GRAPHS)
def test_graph_trains_on_local_executor(graph, tiny_plan, tmp_path):
    plan = tiny_plan(graph)
    trainer, before, after = train(plan, tmp_path, "local")
    try:
        check_parameters(plan.spec, before, after)
        lines = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == [0, 1, 2]
        last = lines[-1]
        for key in ("score/mean", "val/score", "tokens_per_s"):
            assert key in last, key
        for node in plan.spec.nodes.values():  # each node's timing, each update's statistics
            assert f"timing_s/{node.id}" in last, node.id
            if node.uses == "update.policy":
                for stat in ("pg_loss", "clip_frac", "approx_kl", "entropy", "grad_norm", "lr"):
                    assert f"{node.id}/{stat}" in last, (node.id, stat)
            if node.uses.startswith("update."):
                assert f"{node.id}/grad_norm" in last and f"{node.id}/lr" in last, node.id
            if node.uses in ("generate", "agent"):
                assert "response_length/mean" in last
        assert (tmp_path / "run/checkpoints/step_000002/controller.json").exists()
        assert (tmp_path / "run/trace.json").exists()
    finally:
        trainer.close()


def test_step_batch_keys_and_shapes_match_declarations(tiny_plan, tmp_path):
    plan = tiny_plan("ppo.toml")
    spec = plan.spec
    trainer = Trainer(plan, tmp_path / "run", "local")
    try:
        batch = trainer.step(1).batch
        rows, t = batch["responses"].shape
        assert rows == 2 * spec.nodes["generate"].params.n
        for decl in spec.nodes.values():
            for key in decl.writes:
                assert key in batch, key
        for key in (
            "old_logprobs",
            "ref_logprobs",
            "values",
            "token_rewards",
            "advantages",
            "returns",
        ):
            assert batch[key].shape == (rows, t), key
        assert batch["scores"].shape == (rows,)
        # samples of one prompt are adjacent and share a uid
        n = spec.nodes["generate"].params.n
        assert batch["uid"].view(-1, n).unique(dim=1).shape[1] == 1
    finally:
        trainer.close()


def test_grpo_trains_on_ray(tiny_plan, tmp_path):
    ray = pytest.importorskip("ray")
    plan = tiny_plan("grpo.toml", **{"run.num_cpus": 2})
    trainer, before, after = train(plan, tmp_path, "ray")
    try:
        check_parameters(plan.spec, before, after)
        trace = json.loads((tmp_path / "run/trace.json").read_text())
        tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
        assert {"controller", "main/rank0"} <= tracks
        # every slice is a plan item, under the name `flowrl plan` and `render --plan` use
        named = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
        assert named == {item.name for item in plan.items}
        steps = {e["args"]["step"] for e in trace["traceEvents"] if e["ph"] == "X"}
        assert steps == {1, 2}
    finally:
        trainer.close()
        assert not ray.is_initialized()


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_dapo_refills_until_enough_groups_on_both_executors(backend, tiny_plan, tmp_path):
    if backend == "ray":
        pytest.importorskip("ray")
    # 2 prompts a batch, 3 groups wanted: every step needs a second prompt batch at least
    plan = tiny_plan("dapo.toml", **{"nodes.filter.min_groups": 3, "run.num_cpus": 2})
    trainer, before, after = train(plan, tmp_path, backend)
    try:
        check_parameters(plan.spec, before, after)
        lines = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
        for line in lines[1:]:
            assert line["refill/rounds"] >= 2, line
            # the update sees the first 3 informative groups of 8 samples, or fewer if the
            # 4 prompt batches held fewer
            assert line["rows"] == 8 * min(line["refill/groups"], 3)
            assert "update_policy/clip_frac" in line
    finally:
        trainer.close()
