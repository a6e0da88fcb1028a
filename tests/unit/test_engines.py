"""Train and rollout engines on a tiny random model: exactness against naive computations."""

from types import SimpleNamespace

import torch

from flowrl.engines import RolloutEngine, TrainEngine
from flowrl.models.value_head import ValueModel
from flowrl.protocol import DataProto
from flowrl.testing import tiny_model, tiny_tokenizer


def rows(seed=0, b=4, p=6, t=5):
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(2, p + 1, (b,), generator=g)
    resp_len = torch.randint(1, t + 1, (b,), generator=g)
    prompt_mask = (torch.arange(p)[None] >= p - prompt_len[:, None]).long()  # left padded
    response_mask = (torch.arange(t)[None] < resp_len[:, None]).long()
    return DataProto.from_dict(
        {
            "prompts": torch.randint(3, 100, (b, p), generator=g) * prompt_mask,
            "prompt_mask": prompt_mask,
            "responses": torch.randint(3, 100, (b, t), generator=g) * response_mask,
            "response_mask": response_mask,
        }
    )


def naive_logprobs(model, batch):
    """Row by row, no padding: log_softmax over the full sequence, gathered at responses."""
    out = torch.zeros(batch["responses"].shape)
    for i in range(len(batch)):
        prompt = batch["prompts"][i][batch["prompt_mask"][i].bool()]
        response = batch["responses"][i][batch["response_mask"][i].bool()]
        ids = torch.cat([prompt, response])[None]
        logp = model(input_ids=ids).logits[0].log_softmax(-1)  # (s, v)
        for k, token in enumerate(response):
            out[i, k] = logp[len(prompt) - 1 + k, token]
    return out


def test_forward_logprobs_match_naive_and_micro_batching():
    model = tiny_model(seed=0)
    engine = TrainEngine(model, tiny_tokenizer(), trainable=False, micro_tokens=10)
    batch = rows()
    expected = naive_logprobs(model, batch)
    whole = engine.forward(batch, grad=False)["logprobs"]
    torch.testing.assert_close(whole, expected, atol=1e-5, rtol=1e-5)
    micro = torch.cat(
        [engine.forward(m, grad=False)["logprobs"] for m in engine.micro_batches(batch)]
    )
    assert len(engine.micro_batches(batch)) > 1
    torch.testing.assert_close(micro, expected, atol=1e-5, rtol=1e-5)


def test_entropy_matches_naive():
    model = tiny_model(seed=1)
    engine = TrainEngine(model, tiny_tokenizer(), trainable=False)
    batch = rows(1, b=1)
    out = engine.forward(batch, grad=False, entropy=True)
    prompt = batch["prompts"][0][batch["prompt_mask"][0].bool()]
    response = batch["responses"][0][batch["response_mask"][0].bool()]
    p = model(input_ids=torch.cat([prompt, response])[None]).logits[0].softmax(-1)
    expected = -(p * p.log()).sum(-1)[len(prompt) - 1 : len(prompt) - 1 + len(response)]
    torch.testing.assert_close(out["entropy"][0, : len(response)], expected, atol=1e-5, rtol=1e-5)


def test_value_forward_shapes_and_zero_start():
    engine = TrainEngine(ValueModel(tiny_model(seed=0)), tiny_tokenizer(), lr=1e-3)
    out = engine.forward(rows(), grad=False)
    assert out["values"].shape == (4, 5) and torch.equal(out["values"], torch.zeros(4, 5))


def test_step_changes_params_and_follows_warmup():
    model = tiny_model(seed=0)
    engine = TrainEngine(model, tiny_tokenizer(), lr=1e-2, warmup_steps=2, total_steps=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lrs = []
    for _ in range(3):
        engine.backward(engine.forward(rows(), grad=True)["logprobs"].sum())
        lrs.append(engine.step()["lr"])
    assert lrs == [0.005, 0.01, 0.01]  # linear warmup over 2 optimizer steps
    assert any(not torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_offload_reload_keeps_params_and_optimizer_state_bit_identical():
    model = tiny_model(seed=0)
    engine = TrainEngine(model, tiny_tokenizer(), lr=1e-2)
    engine.backward(engine.forward(rows(), grad=True)["logprobs"].sum())
    engine.step()
    params = {k: v.clone() for k, v in model.state_dict().items()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in engine.optimizer.state.items()}
    engine.offload(("weights", "grads", "optimizer"))
    assert engine.resident == set()
    engine.reload(("weights", "grads", "optimizer"))
    assert engine.resident == {"weights", "grads", "optimizer"}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in params.items())
    for p, s in engine.optimizer.state.items():
        assert all(torch.equal(v, state[id(p)][k]) for k, v in s.items())


def test_state_dict_round_trip():
    a = TrainEngine(tiny_model(seed=0), tiny_tokenizer(), lr=1e-2)
    a.backward(a.forward(rows(), grad=True)["logprobs"].sum())
    a.step()
    b = TrainEngine(tiny_model(seed=5), tiny_tokenizer(), lr=1e-2)
    b.load_state_dict(a.state_dict())
    assert all(torch.equal(v, b.module.state_dict()[k]) for k, v in a.module.state_dict().items())
    assert b.scheduler.state_dict() == a.scheduler.state_dict()


def test_greedy_rollout_matches_hf_generate_with_left_padding():
    model, tok = tiny_model(seed=3), tiny_tokenizer()
    batch = rows(2, b=3, p=7)
    engine = RolloutEngine(model, tok)
    out = engine.generate(batch["prompts"], batch["prompt_mask"], max_new_tokens=6, do_sample=False)
    ref = model.generate(
        input_ids=batch["prompts"],
        attention_mask=batch["prompt_mask"],
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )[:, 7:]
    for i in range(3):
        n = int(out["response_mask"][i].sum())
        assert out["responses"][i, :n].tolist() == ref[i, :n].tolist()


class EosAtStepR(torch.nn.Module):
    """A row whose prompt starts with token r emits 10 + r, and EOS at decode step r."""

    def forward(self, input_ids, attention_mask, **kwargs):
        step = attention_mask.shape[1] - 3  # 3 prompt tokens; one mask column per step
        r = input_ids[:, 0] if step == 0 else input_ids[:, -1] - 10
        token = torch.where(r == step, torch.full_like(r, 2), r + 10)
        logits = torch.nn.functional.one_hot(token, 20).float()[:, None]  # (a, 1, v)
        return SimpleNamespace(logits=logits)


def test_response_mask_includes_first_eos_and_nothing_after():
    engine = RolloutEngine(EosAtStepR(), SimpleNamespace(eos_token_id=2, pad_token_id=0))
    prompts = torch.tensor([[0, 1, 1], [1, 1, 1], [3, 1, 1]])
    out = engine.generate(
        prompts, torch.ones(3, 3, dtype=torch.long), max_new_tokens=3, do_sample=False
    )
    assert out["responses"].tolist() == [[2, 0, 0], [11, 2, 0], [13, 13, 13]]
    assert out["response_mask"].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
