"""Loss math: aggregation, KL estimators, PPO policy loss, clipped value loss, entropy."""

import math

import pytest
import torch

from flowrl.math import ops
from flowrl.math.losses import Chunk
from flowrl.math.losses.ppo import ppo_loss
from flowrl.math.losses.value import clipped_value_loss
from flowrl.testing import loss_params


def ragged(seed, b=6, t=5):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    return g, (torch.arange(t)[None] < lengths[:, None]).long()


def test_agg_modes_hand_example():
    loss = torch.tensor([[1.0, 3.0], [2.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # token-mean: (1 + 3 + 2) / 3 = 2; seq-mean-token-sum: (4 + 2) / 2 = 3;
    # seq-mean-token-mean: (2 + 2) / 2 = 2
    assert float(ops.agg_loss(loss, mask, "token-mean")) == pytest.approx(2.0)
    assert float(ops.agg_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx(3.0)
    assert float(ops.agg_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx(2.0)


@pytest.mark.parametrize("mode", ops.AGG_MODES)
def test_micro_batch_losses_sum_to_full_batch_loss(mode):
    g, mask = ragged(0, b=7)
    loss = torch.randn(mask.shape, generator=g)
    full = ops.agg_loss(loss, mask, mode)
    tokens, seqs = mask.sum(), mask.shape[0]
    parts = sum(
        ops.agg_loss(loss[i : i + 3], mask[i : i + 3], mode, tokens, seqs) for i in range(0, 7, 3)
    )
    torch.testing.assert_close(parts, full)


def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([0.0]), torch.tensor([math.log(0.5)])
    # log r = log 2 = 0.6931; k2 = 0.2402; k3 = 0.5 - 1 + 0.6931 = 0.1931
    assert float(ops.kl_estimate(logp, ref, "k1")) == pytest.approx(0.6931, abs=1e-4)
    assert float(ops.kl_estimate(logp, ref, "k2")) == pytest.approx(0.2402, abs=1e-4)
    assert float(ops.kl_estimate(logp, ref, "k3")) == pytest.approx(0.1931, abs=1e-4)
    assert float(ops.kl_estimate(ref, logp, "abs")) == pytest.approx(0.6931, abs=1e-4)


def test_ppo_loss_clips_high_and_low_separately():
    # ratio 1.5 with A = +1: clipped at 1 + 0.28 -> loss -1.28 (vs -1.2 with the usual 0.2)
    logp, old = torch.tensor([[math.log(1.5)]]), torch.zeros(1, 1)
    mask = torch.ones(1, 1, dtype=torch.long)
    params = loss_params(clip_high=0.28, dual_clip=0.0)
    loss, metrics = ppo_loss(logp, old, torch.ones(1, 1), mask, params, Chunk())
    assert float(loss) == pytest.approx(-1.28)
    assert metrics["clip_frac"] == 1.0
    # ratio 0.5 with A = -1: max(0.5, 0.8) = 0.8 (the low clip binds)
    loss, _ = ppo_loss(
        torch.tensor([[math.log(0.5)]]), old, -torch.ones(1, 1), mask, params, Chunk()
    )
    assert float(loss) == pytest.approx(0.8)


def test_dual_clip_bounds_negative_advantages():
    # ratio 5, A = -1: plain PPO loss max(5, 1.2) = 5; dual-clip c = 3 caps it at 3
    logp, old = torch.tensor([[math.log(5.0)]]), torch.zeros(1, 1)
    mask, adv = torch.ones(1, 1, dtype=torch.long), -torch.ones(1, 1)
    plain, dual = loss_params(dual_clip=0.0), loss_params(dual_clip=3.0)
    assert float(ppo_loss(logp, old, adv, mask, plain, Chunk())[0]) == pytest.approx(5.0)
    assert float(ppo_loss(logp, old, adv, mask, dual, Chunk())[0]) == pytest.approx(3.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_loss_matches_loop(seed):
    g, mask = ragged(seed)
    logp, old, adv = (torch.randn(mask.shape, generator=g) * 0.3 for _ in range(3))
    total, count = 0.0, 0
    for i in range(mask.shape[0]):
        for k in range(mask.shape[1]):
            if mask[i, k]:
                r = math.exp(float(logp[i, k] - old[i, k]))
                a = float(adv[i, k])
                value = max(-a * r, -a * min(max(r, 0.8), 1.3))
                if a < 0:
                    value = min(value, -a * 2.0)
                total, count = total + value, count + 1
    params = loss_params(clip_low=0.2, clip_high=0.3, dual_clip=2.0)
    loss, _ = ppo_loss(logp, old, adv, mask, params, Chunk())
    assert float(loss) == pytest.approx(total / count, rel=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_clipped_value_loss_matches_loop(seed):
    g, mask = ragged(seed)
    values, old, returns = (torch.randn(mask.shape, generator=g) for _ in range(3))
    total, count = 0.0, 0
    for i in range(mask.shape[0]):
        for k in range(mask.shape[1]):
            if mask[i, k]:
                v, o, r = float(values[i, k]), float(old[i, k]), float(returns[i, k])
                clipped = o + min(max(v - o, -0.5), 0.5)
                total += max((v - r) ** 2, (clipped - r) ** 2)
                count += 1
    loss, _ = clipped_value_loss(values, old, returns, mask, 0.5)
    assert float(loss) == pytest.approx(0.5 * total / count, rel=1e-5)


def test_the_engines_entropy_is_the_policys_entropy_at_each_response_token():
    # the entropy update.policy trains with (its entropy bonus) and reports: the engine's
    # forward, against -sum p log p of the tiny model's own logits at the positions that
    # predict each response token, divided by the temperature; zero past a row's response
    from flowrl.engines import TrainEngine
    from flowrl.testing import tiny_model, tiny_tokenizer, update_batch

    model, rows = tiny_model(seed=0), update_batch(b=3, t=4, seed=1)
    out = TrainEngine(model, tiny_tokenizer()).forward(
        rows, grad=False, entropy=True, temperature=0.7
    )
    ids = torch.cat([rows["prompts"], rows["responses"]], dim=1)
    mask = torch.cat([rows["prompt_mask"], rows["response_mask"]], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float() / 0.7  # (b, p + t, v)
    p = rows["prompts"].shape[1]
    probs = logits[:, p - 1 : -1].softmax(-1)  # the positions predicting response tokens
    expected = -(probs * probs.log()).sum(-1) * rows["response_mask"]
    torch.testing.assert_close(out["entropy"], expected, rtol=1e-4, atol=1e-5)
    assert bool((expected[rows["response_mask"].bool()] > 0).all())


def test_masked_whiten_zero_mean_unit_var():
    g, mask = ragged(3)
    x = torch.randn(mask.shape, generator=g) * 4 + 2
    w = ops.masked_whiten(x, mask)
    assert float(ops.masked_mean(w, mask)) == pytest.approx(0.0, abs=1e-5)
    assert float(ops.masked_var(w, mask)) == pytest.approx(1.0, abs=1e-4)
