"""Advantage estimators and reward shaping: hand-derived examples and parity with plain loops."""

import pytest
import torch

from flowrl.engines.train.sequence_scores import read_positions
from flowrl.math import ops
from flowrl.math.estimators import (
    discounted_returns,
    gae_advantages,
    group_advantages,
    group_baseline,
    leave_one_out_advantages,
    remax_advantages,
)
from flowrl.nodes.filter.dynamic_sampling import varied_groups
from flowrl.nodes.reward.kl_penalty import Params as KLParams
from flowrl.nodes.reward.kl_penalty import kl_token_rewards, next_kl_coef


def ragged(seed, b=6, t=5):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    return g, mask


# -- hand-derived ------------------------------------------------------------------------------


def test_group_advantages_centers_each_group():
    scores = torch.tensor([1.0, 0.0, 3.0, 3.0])  # two groups of two
    adv = group_advantages(scores, torch.tensor([0, 0, 1, 1]), scale_by_std=False, eps=0)
    # group means are 0.5 and 3.0
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]))


def test_group_advantages_scale_by_std():
    # group [1, 0]: mean 0.5, unbiased std sqrt(0.5) = 0.7071 -> +-0.5 / 0.7071 = +-0.7071
    adv = group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([7, 7]), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([0.7071, -0.7071]), atol=1e-4, rtol=0)


def test_singleton_groups_get_zero():
    adv = group_advantages(torch.tensor([5.0, 1.0, 2.0]), torch.tensor([0, 1, 1]))
    assert adv[0] == 0


def test_rloo_leaves_one_out():
    # group [1, 0, 0]: baselines (0+0)/2 = 0, (1+0)/2 = 0.5, 0.5 -> 1, -0.5, -0.5
    adv = leave_one_out_advantages(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([3, 3, 3]))
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, -0.5]))


def test_gae_hand_example():
    # one row, 2 tokens, rewards [0, 1], values [0.5, 0.5], gamma = lam = 1:
    # delta_1 = 1 + 0 - 0.5 = 0.5, A_1 = 0.5; delta_0 = 0 + 0.5 - 0.5 = 0, A_0 = 0 + 0.5 = 0.5
    adv, ret = gae_advantages(
        torch.tensor([[0.0, 1.0]]),
        torch.tensor([[0.5, 0.5]]),
        torch.tensor([[1, 1]]),
        gamma=1.0,
        lam=1.0,
    )
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0]]))


def test_discounted_returns_hand_example():
    # rewards [1, 0, 2], gamma 0.5: G2 = 2, G1 = 0 + 1 = 1, G0 = 1 + 0.5 = 1.5; pad stays 0
    out = discounted_returns(
        torch.tensor([[1.0, 0.0, 2.0, 9.0]]), torch.tensor([[1, 1, 1, 0]]), gamma=0.5
    )
    torch.testing.assert_close(out, torch.tensor([[1.5, 1.0, 2.0, 0.0]]))


def test_remax_baseline():
    adv = remax_advantages(
        torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor([[1, 1], [1, 0]])
    )
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))


def test_kl_penalty_hand_example():
    # logp - ref = [0.5, 0.5] -> k1 = 0.5 per token; beta 0.1 -> -0.05 each; score 1 on the last
    rewards, kl = kl_token_rewards(
        torch.tensor([1.0]),
        torch.tensor([[0.0, 0.0, 0.0]]),
        torch.tensor([[-0.5, -0.5, 0.0]]),
        torch.tensor([[1, 1, 0]]),
        kl_coef=0.1,
        kind="k1",
    )
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.95, 0.0]]))
    torch.testing.assert_close(kl, torch.tensor([1.0]))


def test_kl_penalty_empty_response():
    rewards, _ = kl_token_rewards(
        torch.tensor([1.0]),
        torch.zeros(1, 2),
        torch.zeros(1, 2),
        torch.tensor([[0, 0]]),
        kl_coef=0.1,
        kind="k1",
    )
    assert torch.equal(rewards, torch.zeros(1, 2))


# -- masks with holes: multi-turn rows, tool output (mask 0) between sampled tokens -----------


def test_gae_carries_value_and_advantage_across_a_hole():
    # two model tokens, two tool tokens, two model tokens; outcome reward 1 on the last,
    # V = 0, gamma = lam = 1: every model token's advantage is 1 (the tool tokens are skipped,
    # so the value and advantage run on across them)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]])
    adv, ret = gae_advantages(
        torch.tensor([[0.0, 0, 0, 0, 0, 1]]), torch.zeros(1, 6), mask, gamma=1.0, lam=1.0
    )
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1, 0, 0, 1, 1]]))
    torch.testing.assert_close(ret, adv)


def test_gae_next_value_is_the_next_trained_tokens():
    # mask [1, 0, 1], rewards [0, 5, 1], values [0.5, 9, 0.25], gamma = lam = 0.5;
    # position 1 is skipped (its reward 5 and value 9 unused):
    # A_2 = 1 + 0 - 0.25 = 0.75
    # delta_0 = 0 + 0.5 * V_2 - V_0 = 0.125 - 0.5 = -0.375; A_0 = -0.375 + 0.25 * 0.75 = -0.1875
    # returns = A + V = [0.3125, 0, 1.0]
    adv, ret = gae_advantages(
        torch.tensor([[0.0, 5.0, 1.0]]),
        torch.tensor([[0.5, 9.0, 0.25]]),
        torch.tensor([[1, 0, 1]]),
        gamma=0.5,
        lam=0.5,
    )
    torch.testing.assert_close(adv, torch.tensor([[-0.1875, 0.0, 0.75]]))
    torch.testing.assert_close(ret, torch.tensor([[0.3125, 0.0, 1.0]]))


def test_discounted_returns_carry_across_a_hole():
    # mask [1, 1, 0, 0, 1, 1], rewards [1, 0, 7, 7, 0, 2] (the 7s sit on tool tokens: unused),
    # gamma 0.5: G5 = 2, G4 = 0 + 0.5 * 2 = 1, G1 = 0 + 0.5 * G4 = 0.5, G0 = 1 + 0.5 * 0.5 = 1.25
    out = discounted_returns(
        torch.tensor([[1.0, 0, 7, 7, 0, 2]]), torch.tensor([[1, 1, 0, 0, 1, 1]]), gamma=0.5
    )
    torch.testing.assert_close(out, torch.tensor([[1.25, 0.5, 0, 0, 1, 2]]))


def test_kl_penalty_puts_the_score_on_the_last_trained_token():
    # mask [1, 1, 0, 0, 1, 1, 0]: mask.sum() - 1 = 3 is a tool token; the last 1 is at 5.
    # logp - ref = 0.5 everywhere -> k1 0.5 on the 4 trained tokens, beta 0.1 -> -0.05 each
    rewards, kl = kl_token_rewards(
        torch.tensor([1.0]),
        torch.zeros(1, 7),
        torch.full((1, 7), -0.5),
        torch.tensor([[1, 1, 0, 0, 1, 1, 0]]),
        kl_coef=0.1,
        kind="k1",
    )
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, -0.05, 0, 0, -0.05, 0.95, 0]]))
    torch.testing.assert_close(kl, torch.tensor([2.0]))  # 4 x 0.5


def test_last_one_and_where_a_reward_model_reads():
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]])
    assert ops.last_one(mask).tolist() == [5, 0, 0]  # an empty row gives 0
    assert ops.last_one(torch.zeros(2, 0)).tolist() == [0, 0]
    ids = torch.tensor([[7, 8, 0, 0, 9, 2, 0], [0] * 7, [2, 0, 0, 0, 0, 0, 0]])
    # no pad id: the last attended token; pad id 2 (= eos): row 0's trailing 2 is skipped, as
    # transformers does, and row 2, all pad, reads its last attended token
    assert read_positions(ids, mask, None).tolist() == [5, 0, 0]
    assert read_positions(ids, mask, 2).tolist() == [4, 0, 0]


def test_adaptive_kl_controller():
    # kl 12 vs target 6: error clipped to 0.2; n/horizon = 0.5 -> coef *= 1.1
    adaptive = KLParams(controller="adaptive", target_kl=6.0, horizon=10)
    assert next_kl_coef(0.1, 12.0, 5, adaptive) == pytest.approx(0.11)
    assert next_kl_coef(0.1, 12.0, 5, KLParams()) == 0.1  # fixed


def test_dynamic_sampling_drops_uniform_groups():
    keep = varied_groups(
        torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1, 2, 2])
    )
    assert keep.tolist() == [False, False, True, True, False, False]


# -- parity with plain loops -------------------------------------------------------------------


def reference_gae(rewards, values, mask, gamma, lam):
    b, t = rewards.shape
    adv = [[0.0] * t for _ in range(b)]
    for i in range(b):
        n = int(mask[i].sum())
        last = 0.0
        for k in reversed(range(n)):
            next_value = float(values[i, k + 1]) if k + 1 < n else 0.0
            delta = float(rewards[i, k]) + gamma * next_value - float(values[i, k])
            last = delta + gamma * lam * last
            adv[i][k] = last
    return torch.tensor(adv)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_loop(seed):
    g, mask = ragged(seed)
    rewards, values = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    expected = reference_gae(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, (expected + values) * mask)


def reference_groups(scores, uid, loo=False, scale=False):
    out = []
    for i in range(len(scores)):
        group = [float(scores[j]) for j in range(len(scores)) if uid[j] == uid[i]]
        if len(group) == 1:
            out.append(0.0)
            continue
        if loo:
            out.append(float(scores[i]) - (sum(group) - float(scores[i])) / (len(group) - 1))
            continue
        mean = sum(group) / len(group)
        std = (sum((x - mean) ** 2 for x in group) / (len(group) - 1)) ** 0.5
        out.append((float(scores[i]) - mean) / (std + 1e-6) if scale else float(scores[i]) - mean)
    return torch.tensor(out)


@pytest.mark.parametrize("seed", [0, 1])
def test_group_estimators_match_loops(seed):
    g = torch.Generator().manual_seed(seed)
    uid = torch.randint(0, 4, (12,), generator=g)
    scores = torch.randn(12, generator=g)
    torch.testing.assert_close(group_advantages(scores, uid, False), reference_groups(scores, uid))
    torch.testing.assert_close(
        group_advantages(scores, uid, True),
        reference_groups(scores, uid, scale=True),
        rtol=1e-4,
        atol=1e-4,
    )
    torch.testing.assert_close(
        leave_one_out_advantages(scores, uid), reference_groups(scores, uid, loo=True)
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_discounted_returns_and_group_baseline_match_loops(seed):
    g, mask = ragged(seed)
    rewards = torch.randn(mask.shape, generator=g)
    expected = torch.zeros(mask.shape)
    for i in range(mask.shape[0]):
        running = 0.0
        for k in reversed(range(int(mask[i].sum()))):
            running = float(rewards[i, k]) + 0.7 * running
            expected[i, k] = running
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.7), expected)
    uid = torch.tensor([0, 0, 1, 1, 1, 2])
    totals = [float((rewards[i] * mask[i]).sum()) for i in range(6)]
    means = [
        sum(totals[j] for j in range(6) if uid[j] == uid[i]) / int((uid == uid[i]).sum())
        for i in range(6)
    ]
    torch.testing.assert_close(group_baseline(rewards, mask, uid), torch.tensor(means))


def holed(seed, b=8, t=7):
    """A random mask with holes inside rows and right padding, like multi-turn rows."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    real = torch.arange(t)[None] < lengths[:, None]
    mask = (real & (torch.rand(b, t, generator=g) < 0.6)).long()
    assert ((mask == 0) & real).any()  # some holes
    return g, mask


def on_trained_tokens(fn, mask, *rows):
    """fn applied to each row's trained tokens alone (holes squeezed out, a mask of ones),
    the result put back at those positions; 0 elsewhere. (b, t)."""
    out = torch.zeros(mask.shape)
    for i in range(len(mask)):
        keep = mask[i].bool()
        ones = torch.ones(1, int(keep.sum()), dtype=torch.long)
        out[i, keep] = fn(*(x[i, keep][None] for x in rows), ones)[0]
    return out


def reference_returns(rewards, mask, gamma):
    out = torch.zeros(rewards.shape)
    for i in range(rewards.shape[0]):
        running = 0.0
        for k in reversed(range(int(mask[i].sum()))):
            running = float(rewards[i, k]) + gamma * running
            out[i, k] = running
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_and_returns_with_holes_equal_rows_with_the_holes_squeezed_out(seed):
    # the recursion runs over trained tokens only: a row with holes gives what the same row
    # without its tool tokens gives, at the same tokens
    g, mask = holed(seed)
    rewards, values = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    expected = on_trained_tokens(
        lambda r, v, m: reference_gae(r, v, m, 0.9, 0.8), mask, rewards, values
    )
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, (expected + values) * mask)
    returns = on_trained_tokens(lambda r, m: reference_returns(r, m, 0.7), mask, rewards)
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.7), returns)
