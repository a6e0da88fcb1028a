"""LoRA through PEFT: the adapter trains and the base does not; the adapter alone is saved and
sent; with adapters off the model is its base (the reference policy); the table is checked."""

import copy
from pathlib import Path

import pytest
import torch

from flowrl.engines import TrainEngine
from flowrl.errors import GraphErrors
from flowrl.front import compiler, dsl
from flowrl.models import lora
from flowrl.models.value_head import ValueModel
from flowrl.nodes import logprob
from flowrl.nodes.update import policy
from flowrl.testing import tiny_model, tiny_tokenizer, update_batch

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples/grpo_lora.toml"


def rows(seed=0):
    return update_batch(b=4, seed=seed)


def engine_with_adapter(seed=0, **settings):
    module = lora.add_adapter(tiny_model(seed=seed), {"rank": 4, "alpha": 8, **settings})
    return TrainEngine(module, tiny_tokenizer(), lr=1e-2)


def logprobs(module, batch):
    engine = TrainEngine(module, tiny_tokenizer(), trainable=False)
    return engine.infer(batch)["logprobs"]


def test_new_adapter_changes_nothing_and_only_it_trains():
    base = tiny_model(seed=0)
    engine = engine_with_adapter(seed=0)
    batch = rows()
    # B starts at zero: the adapted model computes what the base does
    torch.testing.assert_close(engine.infer(batch)["logprobs"], logprobs(base, batch))
    trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # all-linear: q, k, v, o, gate, up, down in each of the 2 layers, A and B each
    assert len(trainable) == 2 * 7 * 2
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    update = policy.PolicyUpdateWorker(engine, policy.Params(on_policy=True))
    update(batch)  # B moves; A gets no gradient while B is zero (dL/dA = B^T ...)
    update(batch)  # now A moves too
    after = engine.module.state_dict()
    for key, value in before.items():
        changed = not torch.equal(value, after[key])
        assert changed == ("lora_" in key), key


def test_adapters_off_is_the_base_model_and_restores_training():
    base = tiny_model(seed=1)
    engine = engine_with_adapter(seed=1)
    batch = rows(seed=1)
    policy.PolicyUpdateWorker(engine, policy.Params(on_policy=True))(batch)
    trained = engine.infer(batch)["logprobs"]
    reference = logprob.LogprobWorker(engine, logprob.Params(adapter=False))(batch)["logprobs"]
    torch.testing.assert_close(reference, logprobs(base, batch))  # the base, not the trained
    assert not torch.allclose(trained, reference)
    torch.testing.assert_close(engine.infer(batch)["logprobs"], trained)  # adapter back on
    assert {n for n, p in engine.module.named_parameters() if p.requires_grad} == {
        n for n in engine.module.state_dict() if "lora_" in n
    }


def test_adapter_off_on_a_model_without_one_is_refused():
    engine = TrainEngine(tiny_model(), tiny_tokenizer(), trainable=False)
    with pytest.raises(ValueError, match="needs a model with a LoRA adapter"):
        logprob.LogprobWorker(engine, logprob.Params(adapter=False))


def test_checkpoint_holds_the_adapter_only_and_restores_it():
    engine = engine_with_adapter(seed=2)
    batch = rows(seed=2)
    policy.PolicyUpdateWorker(engine, policy.Params(on_policy=True))(batch)
    state = engine.state_dict()
    assert set(state["module"]) == {n for n in engine.module.state_dict() if "lora_" in n}
    fresh = engine_with_adapter(seed=2)  # same base (seed), new adapter
    fresh.load_state_dict(copy.deepcopy(state))
    torch.testing.assert_close(fresh.infer(batch)["logprobs"], engine.infer(batch)["logprobs"])
    with pytest.raises(ValueError, match="adapter state does not match"):
        lora.load_weights(fresh.module, {"model.embed_tokens.weight": torch.zeros(1)})


def test_value_model_trains_its_head_and_adapter():
    module = lora.add_adapter(ValueModel(tiny_model(seed=3)), {"rank": 2})
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert {"value_head.weight", "value_head.bias"} <= trainable
    assert all("lora_" in n or n.startswith("value_head.") for n in trainable)


def test_target_modules_limit_the_adapter():
    engine = engine_with_adapter(target_modules=["q_proj", "v_proj"])
    names = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in lora.weights(engine.module)}
    assert names == {"q_proj", "v_proj"}


def test_example_graph_compiles_with_one_copy_of_the_weights():
    plan = compiler.compile_file(EXAMPLE)
    assert list(plan.spec.models) == ["policy"]
    assert plan.spec.models["policy"].lora == {
        "rank": 16,
        "alpha": 32,
        "target_modules": "all-linear",
    }
    assert plan.spec.nodes["ref_logprob"].params.adapter is False


@pytest.mark.parametrize(
    "table, problem",
    [
        ("{ rank = 0 }", "rank must be an integer > 0"),
        ("{ rnak = 4 }", "unknown key 'rnak'"),
        ('{ target_modules = "q_proj" }', "target_modules must be"),
        ("{ alpha = -1 }", "alpha must be a number > 0"),
    ],
)
def test_bad_lora_tables_are_check_errors(table, problem):
    assert problem in lora.settings_problem(dsl_table(table))
    with pytest.raises(GraphErrors) as caught:
        dsl.load(EXAMPLE, [f"models.policy.lora={table}"])
    (found,) = caught.value.problems
    assert "[models.policy]" in str(found) and "a table of rank (an integer > 0)" in str(found)


def dsl_table(text: str) -> dict:
    import tomllib

    return tomllib.loads(f"v = {text}")["v"]


def test_missing_peft_is_a_check_error_with_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a)
    )
    with pytest.raises(GraphErrors) as caught:
        dsl.load(EXAMPLE)
    (problem,) = caught.value.problems
    assert "LoRA needs the package peft" in str(problem) and "pip install peft" in str(problem)
