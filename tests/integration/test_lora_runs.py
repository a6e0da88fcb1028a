"""LoRA runs on tiny models: only the adapter trains and is checkpointed, the reference is the
base (no second model), and a rollout pool receives the adapter after each update."""

from pathlib import Path

import pytest
import torch

from flowrl.runtime.controller import Trainer
from flowrl.testing import parameters, tiny_plan

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

ROOT = Path(__file__).resolve().parents[2]


def run(plan, run_dir, inspect):
    trainer = Trainer(plan, run_dir, "local")
    try:
        before = inspect(trainer)
        trainer.fit()
        return before, inspect(trainer)
    finally:
        trainer.close()


def test_lora_graph_trains_the_adapter_and_checkpoints_it_alone(tmp_path):
    plan = tiny_plan(ROOT / "examples/grpo_lora.toml", tmp_path)
    assert list(plan.pools["main"].configs) == ["policy"]  # the reference is no second model
    weights = lambda t: t.executor.apply("main", parameters, "policy")[0]  # noqa: E731
    before, after = run(plan, tmp_path / "run", weights)
    adapter = {k for k in before if "lora_" in k}
    assert len(adapter) == 2 * 7 * 2  # all-linear, 2 layers, A and B
    for key in before:
        assert torch.equal(before[key], after[key]) == (key not in adapter), key
    saved = torch.load(tmp_path / "run/checkpoints/step_000002/pool-main.pt", weights_only=False)
    assert set(saved["policy"]["module"]) == adapter


def test_rollout_pool_receives_the_adapter(tmp_path):
    lora = "{ rank = 4, alpha = 8 }"
    plan = tiny_plan(
        ROOT / "graphs/grpo_disaggregated.toml", tmp_path, **{"models.policy.lora": lora}
    )
    both = lambda t: [t.executor.apply(p, parameters, "policy")[0] for p in ("train", "gen")]  # noqa: E731
    (_, served_before), (trained, served) = run(plan, tmp_path / "run", both)
    assert trained.keys() == served.keys()
    for key, value in trained.items():
        assert torch.equal(value, served[key]), key  # the gen pool's copy is the trained one
    assert any(not torch.equal(served_before[k], served[k]) for k in served if "lora_" in k)


def test_export_folds_the_adapter_into_the_base_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    from flowrl.runtime.export import export

    plan = tiny_plan(ROOT / "examples/grpo_lora.toml", tmp_path)  # rank 16, alpha 32
    weights = lambda t: t.executor.apply("main", parameters, "policy")[0]  # noqa: E731
    _, trained = run(plan, tmp_path / "run", weights)
    state = AutoModelForCausalLM.from_pretrained(export(tmp_path / "run", tmp_path / "hf"))
    state = state.state_dict()
    assert not [k for k in state if "lora" in k or "base_layer" in k]
    layers = {k.rsplit(".lora_A.", 1)[0] for k in trained if ".lora_A." in k}
    assert len(layers) == 2 * 7
    for layer in layers:
        a = trained[f"{layer}.lora_A.default.weight"]
        b = trained[f"{layer}.lora_B.default.weight"]
        assert b.abs().sum() > 0, layer  # trained away from its zero start
        expected = trained[f"{layer}.base_layer.weight"] + (32 / 16) * b @ a
        torch.testing.assert_close(state[f"{layer}.weight"], expected)
