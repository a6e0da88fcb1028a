"""Loss math: aggregation, KL estimators, PPO policy loss, clipped value loss, entropy."""

import math

import pytest
import torch
from flowrl.nodes.update.critic import clipped_value_loss
from flowrl.nodes.update.policy import ppo_policy_loss

from flowrl.math import ops


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
    loss, metrics = ppo_policy_loss(logp, old, torch.ones(1, 1), mask, 0.2, 0.28)
    assert float(loss) == pytest.approx(-1.28)
    assert metrics["clip_frac"] == 1.0
    # ratio 0.5 with A = -1: max(0.5, 0.8) = 0.8 (the low clip binds)
    loss, _ = ppo_policy_loss(
        torch.tensor([[math.log(0.5)]]), old, -torch.ones(1, 1), mask, 0.2, 0.28
    )
    assert float(loss) == pytest.approx(0.8)


def test_dual_clip_bounds_negative_advantages():
    # ratio 5, A = -1: plain PPO loss max(5, 1.2) = 5; dual-clip c = 3 caps it at 3
    logp, old = torch.tensor([[math.log(5.0)]]), torch.zeros(1, 1)
    mask, adv = torch.ones(1, 1, dtype=torch.long), -torch.ones(1, 1)
    assert float(ppo_policy_loss(logp, old, adv, mask)[0]) == pytest.approx(5.0)
    assert float(ppo_policy_loss(logp, old, adv, mask, dual_clip=3.0)[0]) == pytest.approx(3.0)


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
    loss, _ = ppo_policy_loss(logp, old, adv, mask, 0.2, 0.3, dual_clip=2.0)
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


def test_entropy_from_logits_matches_definition():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0))
    p = logits.softmax(-1)
    torch.testing.assert_close(ops.entropy_from_logits(logits), -(p * p.log()).sum(-1))


def test_masked_whiten_zero_mean_unit_var():
    g, mask = ragged(3)
    x = torch.randn(mask.shape, generator=g) * 4 + 2
    w = ops.masked_whiten(x, mask)
    assert float(ops.masked_mean(w, mask)) == pytest.approx(0.0, abs=1e-5)
    assert float(ops.masked_var(w, mask)) == pytest.approx(1.0, abs=1e-4)
