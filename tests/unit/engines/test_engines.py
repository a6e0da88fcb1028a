"""Train and rollout engines on a tiny random model: exactness against naive computations."""

import io
import math
from types import SimpleNamespace

import attrs
import pytest
import torch

from flowrl.engines import HFRollout, TrainEngine
from flowrl.engines.batch import generate_batch
from flowrl.engines.hf.sampling import nucleus, sample_tokens
from flowrl.models import load_model
from flowrl.nodes import generate, logprob, values
from flowrl.nodes.reward import model as reward_model
from flowrl.protocol import DataProto
from flowrl.testing import ragged_rows, tiny_model, tiny_tokenizer

torch.set_num_threads(1)


def widen(batch, left: int, right: int):
    """The same rows with `left` more prompt columns and `right` more response columns that
    are padding in every row."""
    pad = torch.nn.functional.pad
    return DataProto.from_dict(
        {k: pad(batch[k], (left, 0)) for k in ("prompts", "prompt_mask")}
        | {k: pad(batch[k], (0, right)) for k in ("responses", "response_mask")}
    )


def unpadded(batch, i):
    prompt = batch["prompts"][i][batch["prompt_mask"][i].bool()]
    return prompt, batch["responses"][i][batch["response_mask"][i].bool()]


def naive_log_softmax(model, batch, i):
    """Row i alone, no padding: (log-softmax over the whole sequence (s, v), prompt length)."""
    prompt, response = unpadded(batch, i)
    logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0]
    return logits.log_softmax(-1), len(prompt)


def naive_logprobs(model, batch):
    out = torch.zeros(batch["responses"].shape)
    for i in range(len(batch)):
        logp, p = naive_log_softmax(model, batch, i)
        for k, token in enumerate(unpadded(batch, i)[1]):
            out[i, k] = logp[p - 1 + k, token]
    return out


# -- TrainEngine.forward --------------------------------------------------------------------


def test_forward_logprobs_match_naive_and_trimming_and_micro_batching_keep_them():
    model = tiny_model(seed=0)
    engine = TrainEngine(model, tiny_tokenizer(), trainable=False, micro_tokens=20)
    batch = ragged_rows()
    expected = naive_logprobs(model, batch)
    torch.testing.assert_close(engine.forward(batch, grad=False)["logprobs"], expected)
    # three all-padding prompt columns and two response columns: trimmed, same values
    padded = widen(batch, 3, 2)
    out = engine.forward(padded, grad=False)["logprobs"]
    assert out.shape == (4, 7) and torch.equal(out[:, 5:], torch.zeros(4, 2))
    torch.testing.assert_close(out[:, :5], expected)
    parts = engine.micro_batches(batch)
    assert len(parts) > 1 and sum(len(m) for m in parts) == len(batch)
    micro = torch.cat([engine.forward(m, grad=False)["logprobs"] for m in parts])
    torch.testing.assert_close(micro, expected)
    torch.testing.assert_close(engine.infer(batch)["logprobs"], expected)


def test_repeated_prompts_run_once_with_the_same_outputs_and_gradients(monkeypatch):
    from flowrl.engines.train import engine as train

    model = tiny_model(seed=0)
    engine = TrainEngine(model, tiny_tokenizer(), lr=1e-3)
    batch = ragged_rows(6, b=12, p=30)
    for key in ("prompts", "prompt_mask"):  # 3 prompts x 4 samples, interleaved
        batch[key] = batch[key][torch.arange(12) // 4]
    calls = []
    model.model.register_forward_pre_hook(lambda module, args: calls.append(1))

    def logprobs_and_grads():
        model.zero_grad()
        out = engine.forward(batch, grad=True)["logprobs"]
        out.sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    shared, shared_grads = logprobs_and_grads()
    assert len(calls) == 2  # the 3 distinct prompts, then the 12 responses
    monkeypatch.setattr(train, "MIN_SAVED_PROMPT_TOKENS", 10**9)  # whole sequences per row
    whole, whole_grads = logprobs_and_grads()
    assert len(calls) == 3
    torch.testing.assert_close(shared, naive_logprobs(model, batch))
    torch.testing.assert_close(shared, whole)
    for a, b in zip(shared_grads, whole_grads, strict=True):
        torch.testing.assert_close(a, b)
    critic = TrainEngine(tiny_model(head="value", seed=1), tiny_tokenizer(), trainable=False)
    torch.nn.init.normal_(critic.module.value_head.weight)
    values = critic.forward(batch, grad=False)["values"]
    monkeypatch.setattr(train, "MIN_SAVED_PROMPT_TOKENS", 0)
    torch.testing.assert_close(critic.forward(batch, grad=False)["values"], values)


def test_micro_batches_fit_the_token_budget_after_trimming():
    engine = TrainEngine(tiny_model(), tiny_tokenizer(), trainable=False, micro_tokens=24)
    batch = widen(ragged_rows(3, b=9, p=8, t=6), 4, 0)
    parts = engine.micro_batches(batch)
    for part in parts:
        width = int(part["prompt_mask"].sum(-1).max() + part["response_mask"].sum(-1).max())
        assert len(part) == 1 or len(part) * width <= 24
    # greedy: no two neighbours could have shared one chunk
    for a, b in zip(parts, parts[1:], strict=False):
        both = DataProto.concat([a, b])
        width = int(both["prompt_mask"].sum(-1).max() + both["response_mask"].sum(-1).max())
        assert len(both) * width > 24
    assert torch.equal(DataProto.concat(parts)["responses"], batch["responses"])
    one = TrainEngine(tiny_model(), tiny_tokenizer(), trainable=False, micro_tokens=1)
    assert [len(m) for m in one.micro_batches(batch)] == [1] * 9  # at least one row each


def test_entropy_matches_naive():
    model = tiny_model(seed=1)
    engine = TrainEngine(model, tiny_tokenizer(), trainable=False)
    batch = ragged_rows(1)
    out = engine.forward(batch, grad=False, entropy=True)["entropy"]
    for i in range(len(batch)):
        logp, p = naive_log_softmax(model, batch, i)
        t = int(batch["response_mask"][i].sum())
        expected = -(logp.exp() * logp).sum(-1)[p - 1 : p - 1 + t]  # H = -sum p log p
        torch.testing.assert_close(out[i, :t], expected)
        assert torch.equal(out[i, t:], torch.zeros(5 - t))


def test_temperature_divides_the_logits():
    model = tiny_model(seed=2)
    engine = TrainEngine(model, tiny_tokenizer(), trainable=False)
    batch = ragged_rows(2, b=1)
    out = engine.forward(batch, grad=False, temperature=0.5)["logprobs"]
    prompt, response = unpadded(batch, 0)
    logp = (model(input_ids=torch.cat([prompt, response])[None]).logits[0] / 0.5).log_softmax(-1)
    expected = logp[len(prompt) - 1 : -1].gather(-1, response[:, None]).squeeze(-1)
    torch.testing.assert_close(out[0, : len(response)], expected)


def test_grad_forward_is_differentiable_and_no_grad_output_usable_in_a_graph():
    model = tiny_model(seed=0)
    engine = TrainEngine(model, tiny_tokenizer(), lr=1e-3)
    batch = ragged_rows()
    old = engine.forward(batch, grad=False)["logprobs"]  # made under inference_mode
    new = engine.forward(batch, grad=True)["logprobs"]
    assert new.requires_grad and not old.requires_grad
    (new * old).sum().backward()  # `old` is saved for backward: must be a normal tensor
    assert model.model.embed_tokens.weight.grad is not None


def test_value_forward_at_response_positions_and_zero_start():
    from flowrl.models.value_head import ValueModel

    model = ValueModel(tiny_model(seed=0))  # a new head on a checkpoint starts at zero
    engine = TrainEngine(model, tiny_tokenizer(), lr=1e-3)
    batch = ragged_rows()
    assert torch.equal(engine.forward(batch, grad=False)["values"], torch.zeros(4, 5))
    torch.nn.init.normal_(model.value_head.weight)
    out = engine.forward(batch, grad=False)["values"]
    for i in range(len(batch)):
        prompt, response = unpadded(batch, i)
        full = model(input_ids=torch.cat([prompt, response])[None])[0]  # (s,)
        p, t = len(prompt), len(response)
        torch.testing.assert_close(out[i, :t], full[p - 1 : p - 1 + t])  # state predicting it


def split_rows(seed=7):
    """Multi-turn-like rows: real response tokens (response_attention) of which only some
    were sampled by the policy (response_mask), with tool output between and after them.
    Returns (split rows, the same rows with every real token in response_mask, no split key).
    """
    batch = ragged_rows(seed, b=3, p=6, t=6)
    attention = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]])
    sampled = torch.tensor([[1, 1, 0, 1, 0, 0], [1, 0, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0]])
    responses = torch.randint(3, 100, (3, 6), generator=torch.Generator().manual_seed(seed))
    common = {"prompts": batch["prompts"], "prompt_mask": batch["prompt_mask"]}
    common["responses"] = responses * attention
    split = {"response_mask": sampled, "response_attention": attention}
    plain = {"response_mask": attention}
    return DataProto.from_dict(common | split), DataProto.from_dict(common | plain)


@pytest.mark.parametrize("min_saved", [0, 10**9])  # prompts shared through the cache, or not
def test_forward_attends_to_response_attention_wider_than_response_mask(monkeypatch, min_saved):
    # row 0 trains tokens 0, 1, 3: the untrained token 2 must still be attended to (and count
    # for positions), so token 3's log-prob is the one of the whole sequence; without the split
    # (response_mask = every real token) the trained positions get the same numbers
    from flowrl.engines.train import engine as train

    monkeypatch.setattr(train, "MIN_SAVED_PROMPT_TOKENS", min_saved)
    model = tiny_model(seed=0)
    lm = TrainEngine(model, tiny_tokenizer(), trainable=False, micro_tokens=12)
    split, plain = split_rows()
    sampled = split["response_mask"]
    out = lm.forward(split, grad=False)["logprobs"]
    torch.testing.assert_close(out * sampled, lm.forward(plain, grad=False)["logprobs"] * sampled)
    # at every real token: the log-probs of each whole unpadded sequence; 0 on padding
    torch.testing.assert_close(out, naive_logprobs(model, plain))
    assert len(lm.micro_batches(split)) > 1
    torch.testing.assert_close(lm.infer(split)["logprobs"], out)
    critic = TrainEngine(tiny_model(head="value", seed=1), tiny_tokenizer(), trainable=False)
    torch.nn.init.normal_(critic.module.value_head.weight)
    values = critic.forward(split, grad=False)["values"]
    torch.testing.assert_close(values, critic.forward(plain, grad=False)["values"])


def test_generate_writes_response_attention_and_model_nodes_read_it():
    from flowrl.nodes.update import critic, policy

    gen = generate.GenerateWorker(
        HFRollout(tiny_model(), tiny_tokenizer()), generate.Params(n=2, max_new_tokens=4)
    )
    batch = ragged_rows(4, b=3)
    batch.meta.update(seed=1, step=0)
    out, _ = gen(batch.select(["prompts", "prompt_mask"]))
    assert torch.equal(out["response_attention"], out["response_mask"])  # single-turn: equal
    assert "response_attention" in generate.SPEC.writes
    for node in (logprob, values, reward_model, policy, critic):  # dispatched to their forward
        assert "response_attention" in node.SPEC.reads


def test_reward_model_scores_the_last_real_token():
    # row 0's last real token (index 4) is tool output: the reward model reads the whole
    # conversation, so it scores there, not at the last sampled token (index 3); the head
    # reads that token's own hidden state (a critic's value at token k is from token k - 1)
    model = tiny_model(head="value", seed=1)
    critic = TrainEngine(model, tiny_tokenizer(), trainable=False)
    split, _ = split_rows()
    params = reward_model.Params(tokenizer="policy")
    out, _ = reward_model.RewardModelWorker(critic, params)(split)
    for row, last in enumerate([4, 3, 2]):
        prompt = split["prompts"][row][split["prompt_mask"][row].bool()]
        ids = torch.cat([prompt, split["responses"][row, : last + 1]])[None]
        with torch.no_grad():
            torch.testing.assert_close(out["scores"][row], model(ids)[0, -1])


def test_empty_batch_gives_empty_outputs():
    lm = TrainEngine(tiny_model(), tiny_tokenizer(), trainable=False)
    critic = TrainEngine(tiny_model(head="value"), tiny_tokenizer(), trainable=False)
    empty = ragged_rows().index([])
    assert lm.infer(empty)["logprobs"].shape == (0, 5)
    assert critic.infer(empty)["values"].shape == (0, 5)


# -- TrainEngine updates, schedule, residency, checkpoints ----------------------------------


def loss_step(engine, seed=0):
    engine.backward(engine.forward(ragged_rows(seed), grad=True)["logprobs"].sum())
    return engine.step()


def test_step_changes_params_and_lr_follows_warmup_then_constant():
    model = tiny_model(seed=0)
    engine = TrainEngine(model, tiny_tokenizer(), lr=1e-2, warmup_steps=2, total_steps=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lrs = [loss_step(engine)["lr"] for _ in range(3)]
    assert lrs == [0.005, 0.01, 0.01]  # linear warmup over 2 optimizer steps
    assert any(not torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True)


def test_from_config_reads_the_models_table_and_the_pools_setup():
    from flowrl.front.schema import ModelConfig
    from flowrl.runtime.setup import PoolSetup

    config = ModelConfig(
        path="tiny", trainable=True, lr=1e-2, warmup_steps=2, schedule="cosine",
        min_lr_ratio=0.5, betas=(0.8, 0.9), grad_clip=0.5, micro_tokens=64,
    )  # fmt: skip
    setup = PoolSetup(
        pool="main", device="cpu", threads=1, seed=0, base_dir=".", models={"policy": config},
        optimizer_steps={"policy": 4}, rollout_models=(), nodes=(),
    )  # fmt: skip
    kwargs = {"rank": 0, "world_size": 1, "group": None, "device": "cpu"}
    engine = TrainEngine.from_config(
        tiny_model(), tiny_tokenizer(), config, setup, "policy", **kwargs
    )
    assert (engine.grad_clip, engine.micro_tokens, engine.device) == (0.5, 64, "cpu")
    assert engine.optimizer.defaults["betas"] == (0.8, 0.9)
    assert not engine.sharding.sharded  # "policy" is not in setup.sharded: ddp
    lrs = [loss_step(engine)["lr"] for _ in range(5)]
    # warm-up over 2 steps, then cosine from 1e-2 down to the floor 5e-3 at step 4 of the run's
    # 4 optimizer steps: progress (k - 2) / 2 -> factor 0.5 + 0.25 * (1 + cos(pi * progress))
    assert lrs == pytest.approx([5e-3, 1e-2, 1e-2, 7.5e-3, 5e-3])
    frozen = attrs.evolve(config, trainable=False)
    ref = TrainEngine.from_config(tiny_model(), tiny_tokenizer(), frozen, setup, "ref", **kwargs)
    assert ref.optimizer is None and not ref.trainable


def test_fused_adamw_gives_the_default_optimizers_update():
    models = [tiny_model(seed=0), tiny_model(seed=0)]
    engines = [TrainEngine(m, tiny_tokenizer(), lr=1e-2) for m in models]
    assert engines[0].optimizer.defaults["fused"]
    same = {k: engines[0].optimizer.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")}
    engines[1].optimizer = torch.optim.AdamW(models[1].parameters(), foreach=True, **same)
    engines[1].scheduler = torch.optim.lr_scheduler.LambdaLR(engines[1].optimizer, lambda k: 1)
    for _ in range(3):
        for engine in engines:
            loss_step(engine)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_cosine_schedule_decays_to_the_floor():
    engine = TrainEngine(
        tiny_model(), tiny_tokenizer(), lr=1.0, warmup_steps=1, schedule="cosine",
        total_steps=5, min_lr_ratio=0.1,
    )  # fmt: skip
    lrs = [loss_step(engine)["lr"] for _ in range(6)]
    # step 0 warms up; steps 1..5 follow 0.1 + 0.9 * (1 + cos(pi * (k - 1) / 4)) / 2
    cosine = [0.1 + 0.9 * (1 + math.cos(math.pi * (k - 1) / 4)) / 2 for k in range(1, 6)]
    assert lrs == pytest.approx([1.0, *cosine])
    assert lrs[-1] == pytest.approx(0.1)


def test_grad_clip_bounds_the_norm_the_optimizer_sees():
    engine = TrainEngine(tiny_model(), tiny_tokenizer(), lr=1e-3, grad_clip=1e-3)
    seen, params = [], list(engine.module.parameters())

    def record(optimizer, args, kwargs):
        seen.append(float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))))

    engine.optimizer.register_step_pre_hook(record)
    engine.backward(engine.forward(ragged_rows(), grad=True)["logprobs"].sum())
    norm = engine.step()["grad_norm"]
    assert norm > 1e-2 and seen == [pytest.approx(1e-3, rel=1e-4)]  # reported before clipping


def snapshot(engine):
    params = {k: v.clone() for k, v in engine.module.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}
    state = [{k: v.clone() for k, v in s.items()} for s in engine.optimizer.state.values()]
    return params, grads, state


def test_offload_reload_keeps_params_grads_and_optimizer_state_bit_identical():
    model = tiny_model(seed=0)
    engine = TrainEngine(model, tiny_tokenizer(), lr=1e-2)
    loss_step(engine)
    engine.backward(engine.forward(ragged_rows(1), grad=True)["logprobs"].sum())  # grads pending
    before = snapshot(engine)
    engine.offload(("optimizer",))
    assert engine.resident == {"weights", "grads"}
    engine.offload(("weights", "grads"))
    assert engine.resident == set()
    engine.reload(("weights", "grads", "optimizer"))
    assert engine.resident == {"weights", "grads", "optimizer"}
    after = snapshot(engine)
    assert before[1] and before[2]  # grads and optimizer state exist to be moved
    assert before[1].keys() == after[1].keys() and len(before[2]) == len(after[2])
    assert all(torch.equal(v, after[0][k]) for k, v in before[0].items())
    assert all(torch.equal(v, after[1][k]) for k, v in before[1].items())
    for s, t in zip(before[2], after[2], strict=True):
        assert all(torch.equal(v, t[k]) for k, v in s.items())
    with pytest.raises(ValueError, match="unknown model parts"):
        engine.offload(("kv_cache",))
    frozen = TrainEngine(tiny_model(), tiny_tokenizer(), trainable=False)
    frozen.offload(("weights",))
    frozen.reload(("weights", "grads", "optimizer"))
    assert frozen.resident == {"weights"}  # a frozen model has no grads or optimizer


def test_state_dict_round_trip():
    a = TrainEngine(tiny_model(seed=0), tiny_tokenizer(), lr=1e-2, warmup_steps=3)
    loss_step(a)
    b = TrainEngine(tiny_model(seed=5), tiny_tokenizer(), lr=1e-2, warmup_steps=3)
    saved = io.BytesIO()
    torch.save(a.state_dict(), saved)  # as a checkpoint does (a live state_dict shares tensors)
    saved.seek(0)
    b.load_state_dict(torch.load(saved, weights_only=False))
    assert all(torch.equal(v, b.module.state_dict()[k]) for k, v in a.module.state_dict().items())
    assert b.scheduler.state_dict() == a.scheduler.state_dict()
    assert loss_step(a, 1) == loss_step(b, 1)  # same grad norm and lr from the same state
    assert all(torch.equal(v, b.module.state_dict()[k]) for k, v in a.module.state_dict().items())


# -- loading --------------------------------------------------------------------------------


def test_load_tiny_is_seeded_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    a, tokenizer = load_model("tiny", seed=4)
    assert torch.equal(torch.rand(1), expected)
    b, _ = load_model("tiny", seed=4)
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<pad>"
    value, _ = load_model("tiny", head="value")
    assert hasattr(value, "value_head")


def test_reward_model_directory_loads_its_score_head(tmp_path):
    from transformers import LlamaForSequenceClassification

    config = tiny_model().config
    config.num_labels = 1
    classifier = LlamaForSequenceClassification(config)
    classifier.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    module, _ = load_model(str(tmp_path), head="value")
    ids = torch.tensor([[5, 6, 7, 8]])
    # the classifier scores a sequence at its last token; so does the value head
    torch.testing.assert_close(module(ids)[0, -1], classifier(ids).logits[0, 0])


def test_missing_hub_id_is_a_clear_error():
    from flowrl.models import ModelNotFound

    with pytest.raises(ModelNotFound, match="not in the local cache"):
        load_model("no-such-org/no-such-model-flowrl")


# -- HFRollout --------------------------------------------------------------------------


def hf_greedy(model, tok, batch, new_tokens):
    out = model.generate(
        input_ids=batch["prompts"],
        attention_mask=batch["prompt_mask"],
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    return out[:, batch["prompts"].shape[1] :]


def test_greedy_rollout_matches_hf_generate_with_left_padding():
    model, tok = tiny_model(seed=3), tiny_tokenizer()
    batch = widen(ragged_rows(2, b=4, p=7), 2, 0)  # ragged prompts plus all-padding columns
    assert len(set(batch["prompt_mask"].sum(-1).tolist())) > 1
    engine = HFRollout(model, tok)
    out = generate_batch(
        engine, batch["prompts"], batch["prompt_mask"], max_new_tokens=8, do_sample=False
    )
    ref = hf_greedy(model, tok, batch, 8)
    assert out["responses"].shape == (4, 8)
    for i in range(4):
        n = int(out["response_mask"][i].sum())
        assert out["responses"][i, :n].tolist() == ref[i, :n].tolist()
    # n samples share one prefill: greedy, each sample equals the single one, interleaved
    three = generate_batch(
        engine, batch["prompts"], batch["prompt_mask"], n=3, max_new_tokens=8, do_sample=False
    )
    assert torch.equal(three["responses"], out["responses"].repeat_interleave(3, 0))
    engine.idle()  # the last request gone, the engine frees its cache
    assert engine.runner.cache is None


def test_shared_prompt_prefix_runs_once_and_changes_nothing():
    model, tok = tiny_model(seed=4), tiny_tokenizer()
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 100, (24,), generator=g)  # like a chat template's system prompt
    rest = [torch.randint(3, 100, (k,), generator=g) for k in (1, 5, 3, 7)]
    prompts = [torch.cat([prefix, r]) for r in rest]
    width = max(len(x) for x in prompts)
    batch = DataProto.from_dict(
        {
            "prompts": torch.stack(
                [torch.nn.functional.pad(x, (width - len(x), 0)) for x in prompts]
            ),
            "prompt_mask": torch.stack(
                [(torch.arange(width) >= width - len(x)).long() for x in prompts]
            ),
        }
    )
    engine, calls = HFRollout(model, tok), []
    forward = engine.runner.padded
    engine.runner.padded = lambda ids, *a: calls.append(tuple(ids.shape)) or forward(ids, *a)
    out = generate_batch(
        engine, batch["prompts"], batch["prompt_mask"], max_new_tokens=6, do_sample=False
    )
    assert calls[:2] == [(1, 24), (4, width - 24)]  # the prefix once, then the rest per row
    ref = hf_greedy(model, tok, batch, 6)
    for i in range(4):
        n = int(out["response_mask"][i].sum())
        assert out["responses"][i, :n].tolist() == ref[i, :n].tolist()


class EosAtStepR(torch.nn.Module):
    """A row whose prompt starts with token r emits 10 + r, and EOS (2) at decode step r."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(num_hidden_layers=1, _attn_implementation="sdpa")
        self.unused = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, position_ids, **kwargs):
        step = position_ids[:, -1] - 2  # 3 prompt tokens at positions 0..2
        r = input_ids[:, 0] if input_ids.shape[1] > 1 else input_ids[:, -1] - 10
        token = torch.where(r == step, torch.full_like(r, 2), r + 10)
        logits = torch.nn.functional.one_hot(token, 20).float()[:, None]  # (a, 1, v)
        return SimpleNamespace(logits=logits)


def test_response_mask_includes_first_eos_and_nothing_after():
    engine = HFRollout(EosAtStepR(), SimpleNamespace(eos_token_id=2, pad_token_id=0))
    prompts = torch.tensor([[0, 1, 1], [1, 1, 1], [3, 1, 1], [2, 1, 1], [5, 1, 1]])
    mask = torch.ones(5, 3, dtype=torch.long)
    out = generate_batch(engine, prompts, mask, max_new_tokens=4, do_sample=False)
    # finished rows leave the batch (rows 0 and 1 by step 1): the others' outputs are kept
    assert out["responses"].tolist() == [
        [2, 0, 0, 0], [11, 2, 0, 0], [13, 13, 13, 2], [12, 12, 2, 0], [15, 15, 15, 15],
    ]  # fmt: skip
    assert out["response_mask"].sum(-1).tolist() == [1, 2, 4, 3, 4]
    assert out["response_mask"].tolist()[1] == [1, 1, 0, 0]
    # t is the longest response, not max_new_tokens
    short = generate_batch(engine, prompts[:2], mask[:2], max_new_tokens=6, do_sample=False)
    assert short["responses"].tolist() == [[2, 0], [11, 2]]


def test_sampling_filters():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g)
    greedy = logits.argmax(-1)

    def draw(top_k=0, top_p=1.0):
        return sample_tokens(logits, 1.0, top_k, top_p, True, torch.Generator().manual_seed(1))

    assert torch.equal(draw(top_k=1), greedy)
    assert torch.equal(draw(top_p=1e-6), greedy)  # the most likely token always stays
    assert torch.equal(draw(), draw())  # the generator makes it reproducible
    top5 = logits.topk(5, dim=-1).indices
    assert (draw(top_k=5)[:, None] == top5).any(-1).all()
    # nucleus: the sampled token lies in the smallest top set holding 0.5 of the mass
    probs, order = logits.softmax(-1).sort(-1, descending=True)
    inside = (probs.cumsum(-1) - probs) < 0.5
    picked = draw(top_p=0.5)
    for i in range(64):
        assert picked[i] in order[i][inside[i]]
    assert torch.equal(sample_tokens(logits, 1.0, 0, 1.0, False, None), greedy)


def test_nucleus_candidates_grow_until_they_hold_top_p():
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0)) * 0.5  # flat
    values, order = nucleus(logits, None, 0.7)
    assert values.shape[1] > 64  # the first top-64 held too little mass
    probs, ranked = logits.softmax(-1).sort(-1, descending=True)
    for i in range(8):
        expected = ranked[i][probs[i].cumsum(-1) - probs[i] < 0.7]  # full-sort reference
        assert set(order[i][values[i] > float("-inf")].tolist()) == set(expected.tolist())


def test_sampling_frequencies_follow_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).expand(4000, 3)
    tokens = sample_tokens(logits, 2.0, 0, 1.0, True, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    torch.testing.assert_close(freq, (logits[0] / 2.0).softmax(-1), atol=0.03, rtol=0)


# -- model-node workers ---------------------------------------------------------------------


def test_slot_cache_writes_each_row_at_its_own_offset_and_moves_rows():
    from flowrl.engines.hf.kv_cache import SlotCache, attention_mask

    cache = SlotCache(num_layers=1, slots=3, columns=4)
    keys = torch.arange(2 * 1 * 2 * 2, dtype=torch.float32).reshape(2, 1, 2, 2)  # (a, h, w, d)
    cache.select(1, 3, torch.tensor([[0, 1], [2, 3]]))  # slots 1 and 2, at columns 0 and 2
    k, v = cache.update(keys, -keys, 0)
    assert k.shape == (2, 1, 4, 2) and cache.get_seq_length() == 4
    layer = cache.layers[0]
    torch.testing.assert_close(layer.key_buffer[1, :, :2], keys[0])
    torch.testing.assert_close(layer.key_buffer[2, :, 2:4], keys[1])
    assert (layer.key_buffer[0] == 0).all() and (layer.key_buffer[2, :, :2] == 0).all()
    cache.reserve(slots=5, columns=6)  # grows, keeping the contents
    assert layer.key_buffer.shape == (6, 1, 8, 2)  # doubled: amortised growth
    torch.testing.assert_close(layer.value_buffer[2, :, 2:4], -keys[1])
    cache.move([1, 2], [2, 1], columns=4)  # a swap
    torch.testing.assert_close(layer.key_buffer[2, :, :2], keys[0])
    torch.testing.assert_close(layer.key_buffer[1, :, 2:4], keys[1])
    # each query sees its own row's columns up to its own position
    mask = attention_mask(torch.tensor([0, 2]), 2, 4, torch.float32, eager=False)
    assert mask[:, 0].long().tolist() == [
        [[1, 0, 0, 0], [1, 1, 0, 0]], [[1, 1, 1, 0], [1, 1, 1, 1]],
    ]  # fmt: skip


def test_generated_rows_train_directly():
    model, tok = tiny_model(seed=0), tiny_tokenizer()
    batch = ragged_rows(5, b=2)
    out = generate_batch(
        HFRollout(model, tok), batch["prompts"], batch["prompt_mask"], n=2, max_new_tokens=4
    )
    assert not any(v.is_inference() for v in out.values())
    prompts = {k: batch[k].repeat_interleave(2, 0) for k in ("prompts", "prompt_mask")}
    engine = TrainEngine(model, tok, lr=1e-2)
    logprobs = engine.forward(DataProto.from_dict({**prompts, **out}), grad=True)["logprobs"]
    engine.backward(logprobs.sum())  # no "inference tensors cannot be saved for backward"
    assert engine.step()["grad_norm"] > 0


def test_workers_on_rows_and_on_an_empty_batch():
    tok = tiny_tokenizer()
    gen = generate.GenerateWorker(
        HFRollout(tiny_model(), tok), generate.Params(n=2, max_new_tokens=4)
    )
    batch = ragged_rows(4, b=3)
    batch.meta.update(seed=1, step=0)
    out, metrics = gen(batch.select(["prompts", "prompt_mask"]))
    assert out["responses"].shape[0] == 6 and len(out["response_text"]) == 6
    assert out["response_text"][0] == tok.decode(out["responses"][0], skip_special_tokens=True)
    assert metrics["response_length_max"] <= 4 and metrics["gen_tokens_per_s"] > 0
    empty = batch.index([])
    out, _ = gen(empty.select(["prompts", "prompt_mask"]))
    assert out["responses"].shape == (0, 0) and len(out["response_text"]) == 0
    lm = TrainEngine(tiny_model(), tok, trainable=False)
    critic = TrainEngine(tiny_model(head="value"), tok, trainable=False)
    workers = [
        (logprob.LogprobWorker(lm, logprob.Params()), "logprobs", (3, 5)),
        (values.ValuesWorker(critic, values.Params()), "values", (3, 5)),
        (
            reward_model.RewardModelWorker(critic, reward_model.Params(tokenizer="policy")),
            "scores",
            (3,),
        ),
    ]
    for worker, key, shape in workers:
        full, empty_out = worker(batch), worker(empty)
        full = full[0] if isinstance(full, tuple) else full
        empty_out = empty_out[0] if isinstance(empty_out, tuple) else empty_out
        assert full[key].shape == shape and empty_out[key].shape == (0, *shape[1:])


# -- CUDA (skipped without a GPU) -----------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_cuda_offload_frees_device_memory_and_reload_restores_every_bit():
    model = tiny_model(hidden=256).cuda()
    engine = TrainEngine(model, tiny_tokenizer(), lr=1e-2, device="cuda")
    loss_step(engine)
    engine.backward(engine.forward(ragged_rows(1), grad=True)["logprobs"].sum())
    before = snapshot(engine)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    engine.offload(("weights", "grads", "optimizer"))
    freed = held - torch.cuda.memory_allocated()
    assert all(p.device.type == "cpu" and p.grad.device.type == "cpu" for p in model.parameters())
    engine.reload(("weights", "grads", "optimizer"))
    assert torch.cuda.memory_allocated() == held
    after = snapshot(engine)
    assert all(torch.equal(v, after[0][k]) for k, v in before[0].items())
    assert all(torch.equal(v, after[1][k]) for k, v in before[1].items())
    for s, t in zip(before[2], after[2], strict=True):
        assert all(torch.equal(v, t[k]) for k, v in s.items())
    params = sum(p.numel() * 4 for p in model.parameters())
    assert freed >= 3 * params  # weights, grads and AdamW's two moments (4 x params)


@pytest.mark.gpu
@cuda
def test_cuda_offloads_reuse_page_locked_buffers_and_carry_each_update_back():
    model = tiny_model(hidden=256).cuda()
    engine = TrainEngine(model, tiny_tokenizer(), lr=1e-2, device="cuda")
    parts = ("weights", "grads", "optimizer")

    def update_leaving_grads(seed):
        loss_step(engine, seed)
        engine.backward(engine.forward(ragged_rows(seed + 1), grad=True)["logprobs"].sum())

    update_leaving_grads(0)
    engine.offload(parts)
    assert all(p.is_pinned() and p.grad.is_pinned() for p in model.parameters())
    buffers = {k: b.data_ptr() for k, b in engine.host_copies.buffers.items()}
    assert len(buffers) >= 4 * len(list(model.parameters()))  # weights, grads, 2 moments
    engine.reload(parts)
    update_leaving_grads(2)  # the weights change on the device between two offloads
    updated = snapshot(engine)
    engine.offload(parts)
    # the second offload wrote into the first one's buffers, and they hold the new values
    assert {k: b.data_ptr() for k, b in engine.host_copies.buffers.items()} == buffers
    assert all(torch.equal(p, updated[0][n].cpu()) for n, p in model.named_parameters())
    engine.reload(parts)
    again = snapshot(engine)
    assert all(torch.equal(v, again[0][k]) for k, v in updated[0].items())
    assert all(torch.equal(v, again[1][k]) for k, v in updated[1].items())
    for s, t in zip(updated[2], again[2], strict=True):
        assert all(torch.equal(v, t[k]) for k, v in s.items())


@pytest.mark.gpu
@cuda
def test_cuda_rollout_samples_on_the_device():
    engine = HFRollout(tiny_model().cuda(), tiny_tokenizer(), "cuda")
    batch = ragged_rows(5, b=3)
    meta = {"seed": 1, "step": 2, "rank": 0}
    out = generate_batch(
        engine, batch["prompts"], batch["prompt_mask"], n=2, max_new_tokens=5,
        seed=generate.step_seed(meta),
    )  # fmt: skip
    assert out["responses"].shape[0] == 6 and out["responses"].device.type == "cpu"
    assert out["response_mask"].sum(-1).min() >= 1
