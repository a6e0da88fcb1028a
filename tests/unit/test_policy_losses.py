"""PPO's clip metrics, Dr. GRPO's aggregation and numerical safety: hand-derived values and
finite gradients for extreme log-ratios."""

import math

import pytest
import torch
from flowrl.nodes.update.policy import ppo_policy_loss

from flowrl import ops

ONE = torch.ones(1, 1, dtype=torch.long)


def ragged(seed, b=6, t=5):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    return g, (torch.arange(t)[None] < lengths[:, None]).long()


def random_inputs(seed, scale=0.3):
    """logp (with grad), old, advantages constant per row, mask; ratios spread around 1."""
    g, mask = ragged(seed)
    old = -torch.rand(mask.shape, generator=g) * 3
    logp = (old + torch.randn(mask.shape, generator=g) * scale).requires_grad_()
    adv = torch.randn(mask.shape[0], 1, generator=g).expand(mask.shape).contiguous()
    return logp, old, adv, mask


def grad_of(loss, logp):
    (grad,) = torch.autograd.grad(loss, logp)
    return grad


def rows(mask):
    """Per row, the list of its unmasked token positions."""
    return [[k for k in range(mask.shape[1]) if mask[i, k]] for i in range(mask.shape[0])]


# -- aggregation and PPO metrics ---------------------------------------------------------------


def test_seq_mean_token_sum_norm_hand_example():
    loss = torch.tensor([[1.0, 3.0], [2.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # row sums 4 and 2; divided by t = 2 -> 2, 1; mean over rows 1.5. With a constant 4: 0.75
    assert float(ops.agg_loss(loss, mask, "seq-mean-token-sum-norm")) == pytest.approx(1.5)
    value = ops.agg_loss(loss, mask, "seq-mean-token-sum-norm", norm_length=4)
    assert float(value) == pytest.approx(0.75)


def test_ppo_clip_frac_lower_counts_dual_clip_tokens():
    # token 0: ratio 5, A = -1 -> PPO loss 5 > c = 3, the dual-clip bound acts;
    # token 1: ratio 1, A = -1 -> loss 1 < 3, it does not. 1 of 2 tokens.
    logp = torch.tensor([[math.log(5.0), 0.0]])
    old, adv, mask = torch.zeros(1, 2), -torch.ones(1, 2), torch.ones(1, 2, dtype=torch.long)
    loss, metrics = ppo_policy_loss(logp, old, adv, mask, dual_clip=3.0)
    assert float(loss) == pytest.approx((3.0 + 1.0) / 2)
    assert metrics["clip_frac_lower"] == 0.5
    assert ppo_policy_loss(logp, old, adv, mask)[1]["clip_frac_lower"] == 0.0


def test_ppo_token_weights_scale_each_token():
    # ratio 1, A = [1, 2]: token losses -1, -2; weights [2, 0.5] -> -2, -1; mean -1.5
    loss, _ = ppo_policy_loss(
        torch.zeros(1, 2),
        torch.zeros(1, 2),
        torch.tensor([[1.0, 2.0]]),
        torch.ones(1, 2, dtype=torch.long),
        token_weights=torch.tensor([[2.0, 0.5]]),
    )
    assert float(loss) == pytest.approx(-1.5)


# -- numerical safety: extreme log-ratios ------------------------------------------------------


def extreme_inputs():
    """Rows: (logp, old) of the first token = (0, -100), (-100, 0), (-1e4, 0) (a very unlikely
    sampled token), each with A = +1 and A = -1; two ordinary tokens and one pad per row."""
    pairs = [(0.0, -100.0), (-100.0, 0.0), (-1e4, 0.0)]
    logp = torch.tensor([[lp, -1.0, -2.0, 0.0] for lp, _ in pairs for _ in (1, -1)])
    old = torch.tensor([[o, -1.1, -1.9, 0.0] for _, o in pairs for _ in (1, -1)])
    adv = torch.tensor([[a] * 4 for _ in pairs for a in (1.0, -1.0)])
    mask = torch.tensor([[1, 1, 1, 0]] * len(adv))
    return logp.requires_grad_(), old, adv, mask


LOSSES = {
    "ppo": lambda lp, o, a, m: ppo_policy_loss(lp, o, a, m, 0.2, 0.28)[0],
    "ppo_dual_clip": lambda lp, o, a, m: ppo_policy_loss(lp, o, a, m, dual_clip=3.0)[0],
    **{
        f"kl_{kind}": lambda lp, o, a, m, kind=kind: ops.agg_loss(ops.kl_estimate(lp, o, kind), m)
        for kind in ops.KL_KINDS
    },
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_extreme_log_ratios_give_finite_loss_and_gradients(name):
    logp, old, adv, mask = extreme_inputs()
    loss = LOSSES[name](logp, old, adv, mask)
    assert torch.isfinite(loss), f"{name}: loss {float(loss)}"
    grad = grad_of(loss, logp)
    assert torch.isfinite(grad).all(), f"{name}: gradient {grad}"


def test_extreme_token_leaves_the_others_gradient_intact():
    # PPO: the ordinary tokens (ratio near 1, unclipped) still get -A r / tokens
    logp, old, adv, mask = extreme_inputs()
    loss, _ = ppo_policy_loss(logp, old, adv, mask)
    grad = grad_of(loss, logp)
    ratio = torch.exp(logp.detach()[:, 1:3] - old[:, 1:3])
    torch.testing.assert_close(grad[:, 1:3], -adv[:, 1:3] * ratio / int(mask.sum()))
