"""The rollout's log-probs of its sampled tokens (generate's `return_logprobs`), the input of
truncated importance sampling: at temperature 1 they are the train engine's log-probs of the
same tokens, up to the two code paths' float differences."""

from pathlib import Path

import pytest
import torch

from flowrl.engines import HFRollout, TrainEngine
from flowrl.engines.batch import generate_batch
from flowrl.engines.hf.sampling import sample_tokens
from flowrl.front import compiler
from flowrl.nodes import generate
from flowrl.protocol import DataProto
from flowrl.testing import ragged_rows, tiny_model, tiny_tokenizer

torch.set_num_threads(1)


def sampled_with_logprobs(model, temperature=1.0, top_k=0, do_sample=True, n=3):
    batch = ragged_rows(7, b=3)
    out = generate_batch(
        HFRollout(model, tiny_tokenizer()),
        batch["prompts"],
        batch["prompt_mask"],
        n=n,
        max_new_tokens=6,
        temperature=temperature,
        top_k=top_k,
        do_sample=do_sample,
        seed=0,
        logprobs=True,
    )
    prompts = {k: batch[k].repeat_interleave(n, 0) for k in ("prompts", "prompt_mask")}
    return DataProto.from_dict({**prompts, **out})


def engine_logprobs(model, sampled, temperature=1.0):
    engine = TrainEngine(model, tiny_tokenizer(), trainable=False)
    return engine.infer(sampled, temperature=temperature)["logprobs"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logprobs_equal_the_train_engines_at_the_sampling_temperature(temperature):
    model = tiny_model(seed=3)
    sampled = sampled_with_logprobs(model, temperature)
    mask = sampled["response_mask"]
    assert sampled["logprobs"].shape == mask.shape and mask.sum() > 6
    expected = engine_logprobs(model, sampled, temperature)
    torch.testing.assert_close(sampled["logprobs"], expected * mask, atol=1e-4, rtol=1e-4)
    assert (sampled["logprobs"][mask == 0] == 0).all()


def test_top_k_logprobs_are_renormalised_over_the_candidates():
    # the sampler draws from the top-k only, so each token is likelier there than in the full
    # distribution, by the mass the candidates hold
    model = tiny_model(seed=3)
    sampled = sampled_with_logprobs(model, top_k=3)
    mask = sampled["response_mask"].bool()
    full = engine_logprobs(model, sampled)
    assert (sampled["logprobs"][mask] > full[mask] + 1e-4).all()


def test_greedy_logprobs_are_the_models():
    model = tiny_model(seed=3)
    sampled = sampled_with_logprobs(model, do_sample=False, n=1)
    expected = engine_logprobs(model, sampled) * sampled["response_mask"]
    torch.testing.assert_close(sampled["logprobs"], expected, atol=1e-4, rtol=1e-4)


def test_sample_tokens_logprob_hand_example():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    # top-2 keeps 0.5 and 0.3: renormalised 0.625 and 0.375
    g = torch.Generator().manual_seed(0)
    token, logprob = sample_tokens(logits, 1.0, 2, 1.0, True, g, with_logprobs=True)
    expected = {0: 0.625, 1: 0.375}[int(token)]
    assert float(logprob.exp()) == pytest.approx(expected)
    token, logprob = sample_tokens(logits, 1.0, 0, 1.0, False, None, with_logprobs=True)
    assert int(token) == 0 and float(logprob.exp()) == pytest.approx(0.5)


def test_generate_writes_rollout_logprobs_only_when_asked():
    engine = HFRollout(tiny_model(), tiny_tokenizer())
    batch = ragged_rows(4, b=2).select(["prompts", "prompt_mask"])
    batch.meta.update(seed=1, step=0)
    plain, _ = generate.GenerateWorker(engine, generate.Params(n=2, max_new_tokens=4))(batch)
    assert "rollout_logprobs" not in plain
    asked = generate.Params(n=2, max_new_tokens=4, return_logprobs=True)
    out, _ = generate.GenerateWorker(engine, asked)(batch)
    assert out["rollout_logprobs"].shape == out["response_mask"].shape
    assert torch.equal(out["responses"], plain["responses"])  # the same draws
    assert generate.SPEC.writes_for(asked)[-1] == "rollout_logprobs"
    assert "rollout_logprobs" not in generate.SPEC.writes_for(generate.Params())


def test_a_graph_wires_rollout_logprobs_to_truncated_importance_sampling(tmp_path):
    path = tmp_path / "grpo_tis.toml"
    text = (Path(__file__).resolve().parents[3] / "graphs/grpo.toml").read_text()
    path.write_text(
        text.replace("max_new_tokens = 20", "max_new_tokens = 20\nreturn_logprobs = true")
        + "tis_cap = 2.0\n"
    )
    plan = compiler.compile_file(path)
    assert plan.graph.writers["rollout_logprobs"] == "generate"
    assert "rollout_logprobs" in plan.item("dispatch:update_policy").keys
