"""Update workers on a tiny model: skipping zero-advantage rows and micro-batching change
nothing about the resulting parameters."""

import copy
import math

import attrs
import pytest
import torch

from flowrl.engines import TrainEngine
from flowrl.math.losses import LOSSES, Chunk, loss_params
from flowrl.math.losses.ppo import ppo_loss
from flowrl.math.losses.value import clipped_value_loss
from flowrl.models.value_head import ValueModel
from flowrl.nodes.update import policy
from flowrl.nodes.update.critic import CriticUpdateWorker
from flowrl.nodes.update.critic import Params as CriticParams
from flowrl.protocol import DataProto
from flowrl.testing import assert_same, first_step, tiny_model, tiny_tokenizer, update_rows


def test_skipping_zero_advantage_rows_keeps_the_update():
    model = tiny_model(seed=0)
    skipped, metrics = first_step(model, policy.PolicyUpdateWorker, policy.Params())
    assert metrics["computed_rows"] == pytest.approx(0.5)  # 3 of 6 rows skipped
    no_skip = policy.Params(skip_zero_rows=False)
    full, full_metrics = first_step(model, policy.PolicyUpdateWorker, no_skip)
    assert full_metrics["computed_rows"] == 1.0
    assert_same(skipped, full)
    assert metrics["pg_loss"] == pytest.approx(full_metrics["pg_loss"], rel=1e-5)


def test_on_policy_update_equals_one_with_a_separate_old_logprob_pass():
    # on_policy = true takes the old log-probs from the update's own forward, detached; an
    # old_logprob node computes them with a separate forward of the same weights first
    model = tiny_model(seed=0)
    rows = update_rows()
    engine = TrainEngine(copy.deepcopy(model), tiny_tokenizer())
    old = engine.infer(rows)["logprobs"]
    with_pass = DataProto.from_dict(
        {k: rows[k] for k in rows.keys() if k != "old_logprobs"} | {"old_logprobs": old}
    )
    grads = []
    for params, data in ((policy.Params(on_policy=True), rows), (policy.Params(), with_pass)):
        engine = TrainEngine(copy.deepcopy(model), tiny_tokenizer(), lr=1e-2)
        step = engine.step

        def record(engine=engine, step=step):
            grads.append({n: p.grad.clone() for n, p in engine.module.named_parameters()})
            return step()

        engine.step = record
        policy.PolicyUpdateWorker(engine, params)(data)
    assert_same(grads[0], grads[1])
    assert any(g.abs().sum() > 0 for g in grads[0].values())


def test_no_skip_when_kl_or_entropy_terms_need_every_row():
    adv = torch.zeros(3, 2)
    assert policy.contributing_rows(adv, policy.Params(kl_loss_coef=0.1)).all()
    assert policy.contributing_rows(adv, policy.Params(entropy_coef=0.1)).all()
    assert not policy.contributing_rows(adv, policy.Params()).any()
    assert policy.contributing_rows(adv, policy.Params(skip_zero_rows=False)).all()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_policy_micro_batches_give_the_same_update(agg):
    model = tiny_model(seed=1)
    params = policy.Params(agg=agg, entropy_coef=0.01)
    whole, _ = first_step(model, policy.PolicyUpdateWorker, params, micro_tokens=4096)
    pieces, _ = first_step(model, policy.PolicyUpdateWorker, params, micro_tokens=9)
    assert_same(whole, pieces)


def test_critic_micro_batches_give_the_same_update():
    model = ValueModel(tiny_model(seed=2))
    torch.nn.init.normal_(model.value_head.weight, std=0.1)
    whole, m1 = first_step(model, CriticUpdateWorker, CriticParams(), micro_tokens=4096)
    pieces, m2 = first_step(model, CriticUpdateWorker, CriticParams(), micro_tokens=9)
    assert_same(whole, pieces)
    assert m1["vf_loss"] == pytest.approx(m2["vf_loss"], rel=1e-5)


def test_mini_batches_take_several_optimizer_steps():
    model = tiny_model(seed=3)
    _, metrics = first_step(
        model, policy.PolicyUpdateWorker, policy.Params(mini_batch_size=2, epochs=2)
    )
    assert metrics["lr"] == 1e-2 and "grad_norm" in metrics


def with_tool_tokens(rows):
    """rows whose second response token, where a later one exists, is tool output: attended
    (response_attention) but not sampled (response_mask); the values a loss reads there are
    changed (large advantages and returns; old log-probs moved inside the clip range), which
    must not matter."""
    attention = rows["response_mask"]
    hole = torch.zeros_like(attention)
    hole[:, 1] = attention[:, 2]  # a 0 inside the row, not at its end
    assert hole.any()
    out = {k: rows[k] for k in rows.keys()} | {
        "response_mask": attention - hole,
        "response_attention": attention,
    }
    for key, planted in (("advantages", 50.0), ("values", 50.0), ("returns", 50.0)):
        out[key] = torch.where(hole.bool(), torch.full_like(rows[key], planted), rows[key])
    out["old_logprobs"] = rows["old_logprobs"] + 0.05 * hole
    return DataProto.from_dict(out)


def reference_grads(model, loss_of):
    """Gradients of loss_of(engine) on a fresh engine: one backward, no optimizer step."""
    engine = TrainEngine(copy.deepcopy(model), tiny_tokenizer(), lr=1e-2)
    loss_of(engine).backward()
    return {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}


def test_policy_update_attends_to_tool_tokens_and_trains_only_sampled_ones():
    # the update equals: a forward over every real token (no split), then the loss over the
    # sampled tokens only; the values planted on the tool tokens change nothing
    model = tiny_model(seed=4)
    rows = with_tool_tokens(update_rows())
    sampled = rows["response_mask"]
    plain = DataProto.from_dict(
        {k: rows[k] for k in ("prompts", "prompt_mask", "responses")}
        | {"response_mask": rows["response_attention"]}
    )

    def loss_of(engine):
        logprobs = engine.forward(plain, grad=True)["logprobs"]
        no_dual = policy.Params(dual_clip=0.0)
        return ppo_loss(
            logprobs, rows["old_logprobs"], rows["advantages"], sampled, no_dual, Chunk()
        )[0]

    grads, _ = first_step(model, policy.PolicyUpdateWorker, policy.Params(), rows=rows)
    assert_same(grads, reference_grads(model, loss_of))


def test_critic_update_attends_to_tool_tokens_and_trains_only_sampled_ones():
    model = ValueModel(tiny_model(seed=5))
    torch.nn.init.normal_(model.value_head.weight, std=0.1)
    rows = with_tool_tokens(update_rows())
    plain = DataProto.from_dict(
        {k: rows[k] for k in ("prompts", "prompt_mask", "responses")}
        | {"response_mask": rows["response_attention"]}
    )

    def loss_of(engine):
        values = engine.forward(plain, grad=True)["values"]
        return clipped_value_loss(values, rows["values"], rows["returns"], rows["response_mask"])[0]

    grads, _ = first_step(model, CriticUpdateWorker, CriticParams(), rows=rows)
    assert_same(grads, reference_grads(model, loss_of))


# -- the loss param ----------------------------------------------------------------------------


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo", "gpg", "gmpo", "sapo"])
def test_each_policy_loss_gives_the_same_update_in_micro_batches(loss):
    # on-policy, so every loss starts at ratio 1 and has a gradient
    model = tiny_model(seed=1)
    params = policy.Params(loss=loss, on_policy=True, agg="seq-mean-token-sum-norm")
    whole, metrics = first_step(model, policy.PolicyUpdateWorker, params, micro_tokens=4096)
    pieces, _ = first_step(model, policy.PolicyUpdateWorker, params, micro_tokens=9)
    assert_same(whole, pieces)
    assert any(g.abs().sum() > 0 for g in whole.values())
    assert set(LOSSES[loss].rates) <= metrics.keys()


@pytest.mark.parametrize("shift, scale", [(math.log(2.0), 0.5), (-math.log(4.0), 2.0)])
def test_tis_weights_scale_the_update(shift, scale):
    # rollout log-probs = old + shift: every weight is exp(-shift) = 0.5, or 4 capped at 2,
    # so the gradient is the plain one times 0.5 or 2
    model = tiny_model(seed=0)
    rows = update_rows()
    with_rollout = DataProto.from_dict(
        {k: rows[k] for k in rows.keys()} | {"rollout_logprobs": rows["old_logprobs"] + shift}
    )
    plain, _ = first_step(model, policy.PolicyUpdateWorker, policy.Params())
    tis = policy.Params(tis_cap=2.0)
    weighted, _ = first_step(model, policy.PolicyUpdateWorker, tis, rows=with_rollout)
    assert_same(weighted, {n: g * scale for n, g in plain.items()})
    assert any(g.abs().sum() > 0 for g in plain.values())
    assert "rollout_logprobs" in policy.SPEC.reads_for(policy.Params(tis_cap=2.0))
    assert "rollout_logprobs" not in policy.SPEC.reads_for(policy.Params())


def test_covariance_losses_compute_every_row():
    adv = torch.zeros(3, 2)
    assert policy.contributing_rows(adv, policy.Params(loss="clip_cov")).all()
    assert policy.contributing_rows(adv, policy.Params(loss="kl_cov")).all()


def test_each_loss_reads_exactly_the_params_its_record_names():
    # the record's `params` drive `flowrl check` (a loss-only param set under a loss that
    # ignores it is refused): moving a named param changes the loss or its gradient, moving
    # any other loss-only param changes neither
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(16, 6, dtype=torch.long)  # enough rows for every sign of A and log r
    logp, old = (torch.randn(16, 6, generator=g) * 0.3 - 1 for _ in range(2))
    adv = torch.randn(16, 1, generator=g).expand(16, 6) * 6  # Cov in Clip-Cov's (1, 5) too
    moved = dict(clip_low=0.0, clip_high=0.0, dual_clip=1.01, tau_pos=5.0, tau_neg=0.1)
    moved |= dict(cov_ratio=0.5, cov_kl_coef=7.0)
    assert set(moved) == set(loss_params())

    def outcome(loss, params):
        x = logp.clone().requires_grad_()
        chunk = Chunk(generator=torch.Generator().manual_seed(0))  # Clip-Cov's draw
        value = loss.fn(x, old, adv, mask, params, chunk)[0]
        return torch.cat([value.detach()[None], torch.autograd.grad(value, x)[0].flatten()])

    for name, loss in LOSSES.items():
        base = policy.Params(loss=name)
        before = outcome(loss, base)
        for param, new in moved.items():
            after = outcome(loss, attrs.evolve(base, **{param: new}))
            assert (not torch.equal(before, after)) == (param in loss.params), (name, param)


def test_update_loop_reports_every_named_metric_from_a_rank_without_rows():
    # a rank whose share of the step is empty never calls the loss, yet sums the same metric
    # keys as the others (one all-reduce per key) and takes its optimizer step
    engine = TrainEngine(tiny_model(seed=0), tiny_tokenizer(), lr=1e-2)
    calls = []

    def micro_loss(micro, counts):
        calls.append(len(micro))
        raise AssertionError("no micro-batch to compute")

    empty = update_rows().index(slice(0, 0))
    metrics = engine.update(empty, micro_loss, epochs=2, metrics=("pg_loss", "entropy"))
    assert calls == []
    assert metrics["pg_loss"] == metrics["entropy"] == 0.0
    assert metrics["grad_norm"] == 0.0 and metrics["lr"] == 1e-2


def test_update_batch_carries_every_key_the_policy_update_reads():
    from flowrl.testing import tiny_engine, update_batch

    rows = update_batch()
    assert set(policy.SPEC.reads_for(policy.Params())) <= set(rows.keys())
    torch.testing.assert_close(rows["response_attention"], rows["response_mask"])
    _, metrics = policy.PolicyUpdateWorker(tiny_engine(), policy.Params())(rows)
    assert metrics["grad_norm"] > 0
