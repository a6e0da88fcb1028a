"""Policy losses beyond PPO (GSPO, CISPO, GPG, GMPO, SAPO, Clip-Cov, KL-Cov), truncated IS,
Dr. GRPO's aggregation and numerical safety: hand-derived values, parity with plain loops, and
finite gradients for extreme log-ratios."""

import math

import pytest
import torch

from flowrl.math import ops
from flowrl.math.losses import Chunk, tis_weights
from flowrl.math.losses.cispo import cispo_loss
from flowrl.math.losses.cov import clip_cov_loss, kl_cov_loss, token_covariance
from flowrl.math.losses.gmpo import gmpo_loss
from flowrl.math.losses.gpg import gpg_loss
from flowrl.math.losses.gspo import gspo_loss
from flowrl.math.losses.ppo import ppo_loss
from flowrl.math.losses.sapo import sapo_loss
from flowrl.testing import loss_params as P

ONE = torch.ones(1, 1, dtype=torch.long)
SEQ = "seq-mean-token-mean"
NO_DUAL = P(dual_clip=0.0)  # PPO without dual-clip
GSPO = P(clip_low=3e-4, clip_high=4e-4, agg=SEQ)  # the paper's clip range
CISPO = P(clip_low=None, clip_high=0.28)  # no floor, as the paper
GMPO = P(clip_low=0.4, clip_high=0.4)  # the paper's range, in log space


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
    loss, metrics = ppo_loss(logp, old, adv, mask, P(dual_clip=3.0), Chunk())
    assert float(loss.detach()) == pytest.approx((3.0 + 1.0) / 2)
    assert metrics["clip_frac_lower"] == 0.5
    assert ppo_loss(logp, old, adv, mask, NO_DUAL, Chunk())[1]["clip_frac_lower"] == 0.0


def test_ppo_token_weights_scale_each_token():
    # ratio 1, A = [1, 2]: token losses -1, -2; weights [2, 0.5] -> -2, -1; mean -1.5
    loss, _ = ppo_loss(
        torch.zeros(1, 2),
        torch.zeros(1, 2),
        torch.tensor([[1.0, 2.0]]),
        torch.ones(1, 2, dtype=torch.long),
        NO_DUAL,
        Chunk(token_weights=torch.tensor([[2.0, 0.5]])),
    )
    assert float(loss.detach()) == pytest.approx(-1.5)


# -- truncated importance sampling -------------------------------------------------------------


def test_tis_weights_truncate_and_detach():
    # exp(log 0.5 - log 0.1) = 5 -> capped at 2; exp(log 0.1 - log 0.2) = 0.5 stays
    old = torch.tensor([[math.log(0.5), math.log(0.1)]], requires_grad=True)
    rollout = torch.tensor([[math.log(0.1), math.log(0.2)]])
    w = tis_weights(old, rollout, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5]]))
    assert not w.requires_grad


# -- GSPO --------------------------------------------------------------------------------------


def test_gspo_hand_example():
    # one row, log-ratios [log 2, 0]: s = exp(log 2 / 2) = sqrt 2 = 1.41421 on both tokens.
    logp = torch.tensor([[math.log(2.0), 0.0]], requires_grad=True)
    old, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.long)
    # A = +1, clip 0.2: max(-1.41421, -1.2) = -1.2 on each token; clipped -> no gradient
    loss, metrics = gspo_loss(logp, old, torch.ones(1, 2), mask, P(agg=SEQ), Chunk())
    assert float(loss.detach()) == pytest.approx(-1.2)
    assert metrics["clip_frac"] == 1.0
    assert torch.equal(grad_of(loss, logp), torch.zeros(1, 2))
    # A = -1: max(1.41421, 1.2) = 1.41421. The sequence form -A s_i has d/dlogp_t = s_i / |y_i|
    # = 0.70711 on each token; the token form with stop-gradients must give the same.
    loss, _ = gspo_loss(logp, old, -torch.ones(1, 2), mask, P(agg=SEQ), Chunk())
    assert float(loss.detach()) == pytest.approx(math.sqrt(2))
    torch.testing.assert_close(grad_of(loss, logp), torch.full((1, 2), math.sqrt(2) / 2))


@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_matches_loop(seed):
    logp, old, adv, mask = random_inputs(seed)
    total, expected_grad = 0.0, torch.zeros(mask.shape)
    for i, tokens in enumerate(rows(mask)):
        n = len(tokens)
        s = math.exp(sum(float(logp[i, k].detach() - old[i, k]) for k in tokens) / n)
        for k in tokens:
            a = float(adv[i, k])
            unclipped, clipped = -a * s, -a * min(max(s, 0.8), 1.3)
            total += max(unclipped, clipped) / n
            if unclipped >= clipped:  # the unclipped branch carries the gradient s grad logp
                expected_grad[i, k] = -a * s / n / mask.shape[0]
    loss, _ = gspo_loss(logp, old, adv, mask, P(clip_high=0.3, agg=SEQ), Chunk())
    assert float(loss.detach()) == pytest.approx(total / mask.shape[0], rel=1e-5)
    torch.testing.assert_close(grad_of(loss, logp), expected_grad)


@pytest.mark.parametrize("log_ratio", [9.0, 15.0, 30.0])
def test_gspo_ratio_is_bounded_at_e10_with_no_gradient_past_it(log_ratio):
    # one row of two tokens with log-ratio x each: s = e^x, A = -1, so the unclipped branch
    # -A s binds. Below the bound (x = 9) the loss is e^9 per token and d/dlogp_t = e^9 / 2;
    # past it (x = 15, 30) s stops at e^10, as verl's GSPO, and no token keeps a gradient
    # (an unclamped path would leave -A e^x / 2, up to e^20 / 2).
    logp = torch.full((1, 2), log_ratio, requires_grad=True)
    old, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.long)
    loss, _ = gspo_loss(logp, old, -torch.ones(1, 2), mask, GSPO, Chunk())
    bounded = min(log_ratio, 10.0)
    assert float(loss.detach()) == pytest.approx(math.exp(bounded), rel=1e-6)
    expected = math.exp(log_ratio) / 2 if log_ratio < 10 else 0.0
    torch.testing.assert_close(grad_of(loss, logp), torch.full((1, 2), expected))


# -- CISPO -------------------------------------------------------------------------------------


def test_cispo_hand_example():
    # r = 0.55 / 0.5 = 1.1 (inside the clip): loss = -1.1 * 1 * log 0.55 = 0.65762;
    # the weight is detached, so d/dlogp = -w A = -1.1 (not -1.1 - A logp r)
    logp = torch.tensor([[math.log(0.55)]], requires_grad=True)
    loss, _ = cispo_loss(
        logp, torch.tensor([[math.log(0.5)]]), torch.ones(1, 1), ONE, CISPO, Chunk()
    )
    assert float(loss.detach()) == pytest.approx(0.65762, abs=1e-5)
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[-1.1]]))
    # r = 2 is capped at 1 + 0.28 = 1.28, and still has a gradient: -1.28
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    old = torch.tensor([[math.log(0.25)]])
    loss, metrics = cispo_loss(logp, old, torch.ones(1, 1), ONE, CISPO, Chunk())
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[-1.28]]))
    assert metrics["clip_frac"] == 1.0
    # no floor by default: r = 0.1 keeps its weight 0.1; clip_low = 0.2 raises it to 0.8
    logp = torch.tensor([[math.log(0.1)]], requires_grad=True)
    loss, _ = cispo_loss(logp, torch.zeros(1, 1), torch.ones(1, 1), ONE, CISPO, Chunk())
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[-0.1]]))
    floor = P(clip_low=0.2, clip_high=0.28)
    loss, _ = cispo_loss(logp, torch.zeros(1, 1), torch.ones(1, 1), ONE, floor, Chunk())
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[-0.8]]))


@pytest.mark.parametrize("seed", [0, 1])
def test_cispo_matches_loop(seed):
    logp, old, adv, mask = random_inputs(seed)
    total, count, weights = 0.0, int(mask.sum()), torch.zeros(mask.shape)
    for i, tokens in enumerate(rows(mask)):
        for k in tokens:
            w = min(max(math.exp(float(logp[i, k].detach() - old[i, k])), 0.9), 1.2)
            total += -w * float(adv[i, k]) * float(logp[i, k].detach())
            weights[i, k] = w
    loss, _ = cispo_loss(logp, old, adv, mask, P(clip_low=0.1, clip_high=0.2), Chunk())
    assert float(loss.detach()) == pytest.approx(total / count, rel=1e-5)
    torch.testing.assert_close(grad_of(loss, logp), -weights * adv * mask / count)


# -- GPG ---------------------------------------------------------------------------------------


def test_gpg_hand_example():
    # tokens (logp, A): (-1, 1), (-2, 1), (-3, -0.5), pad: -A logp = 1, 2, -1.5; mean 0.5
    logp = torch.tensor([[-1.0, -2.0], [-3.0, -9.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-0.5, 7.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, _ = gpg_loss(logp, None, adv, mask, P(), Chunk())
    assert float(loss.detach()) == pytest.approx(0.5)
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[-1.0, -1.0], [0.5, 0.0]]) / 3)


@pytest.mark.parametrize("seed", [0, 1])
def test_gpg_matches_loop(seed):
    logp, _, adv, mask = random_inputs(seed)
    per_row = []
    for i, tokens in enumerate(rows(mask)):
        per_row.append(sum(-float(adv[i, k]) * float(logp[i, k].detach()) for k in tokens))
    params = P(agg="seq-mean-token-sum-norm")
    loss, _ = gpg_loss(logp, None, adv, mask, params, Chunk(norm_length=10))
    assert float(loss.detach()) == pytest.approx(sum(per_row) / 10 / len(per_row), rel=1e-5)


# -- GMPO --------------------------------------------------------------------------------------


def test_gmpo_hand_example():
    # log-ratios [0.6, -0.2], range [-0.4, 0.4] in log space.
    logp = torch.tensor([[0.6, -0.2]], requires_grad=True)
    old, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.long)
    # A = +1 keeps min(l, clip(l)): [0.4, -0.2], mean 0.1 -> loss -exp(0.1) = -1.10517;
    # token 0 is clipped (no gradient), token 1: -A exp(0.1) / 2 = -0.55259
    loss, metrics = gmpo_loss(logp, old, torch.ones(1, 2), mask, GMPO, Chunk())
    assert float(loss.detach()) == pytest.approx(-math.exp(0.1))
    assert metrics["clip_frac"] == 0.5
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[0.0, -math.exp(0.1) / 2]]))
    # A = -1 keeps max(l, clip(l)): [0.6, -0.2], mean 0.2 -> loss +exp(0.2) = 1.22140
    loss, metrics = gmpo_loss(logp, old, -torch.ones(1, 2), mask, GMPO, Chunk())
    assert float(loss.detach()) == pytest.approx(math.exp(0.2))
    assert metrics["clip_frac"] == 0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_gmpo_matches_loop(seed):
    logp, old, adv, mask = random_inputs(seed)
    total, expected_grad = 0.0, torch.zeros(mask.shape)
    for i, tokens in enumerate(rows(mask)):
        a = float(adv[i, tokens[0]])  # constant over the row
        kept = []
        for k in tokens:
            raw = float(logp[i, k].detach() - old[i, k])
            clipped = min(max(raw, -0.3), 0.25)
            kept.append(min(raw, clipped) if a > 0 else max(raw, clipped))
        ratio = math.exp(sum(kept) / len(tokens))
        total += -a * ratio
        for k, value in zip(tokens, kept, strict=True):
            if value == float(
                logp[i, k].detach() - old[i, k]
            ):  # unclipped: d/dlogp = -A ratio / |y|
                expected_grad[i, k] = -a * ratio / len(tokens) / mask.shape[0]
    loss, _ = gmpo_loss(logp, old, adv, mask, P(clip_low=0.3, clip_high=0.25), Chunk())
    assert float(loss.detach()) == pytest.approx(total / mask.shape[0], rel=1e-5)
    torch.testing.assert_close(grad_of(loss, logp), expected_grad)


# -- SAPO --------------------------------------------------------------------------------------


def test_sapo_hand_example():
    # r = 1, A = +1, tau 1: f = 4 sigmoid(0) = 2 -> loss -2; gradient -A 4 s (1 - s) r = -1
    logp = torch.zeros(1, 1, requires_grad=True)
    loss, metrics = sapo_loss(logp, torch.zeros(1, 1), torch.ones(1, 1), ONE, P(agg=SEQ), Chunk())
    assert float(loss.detach()) == pytest.approx(-2.0)
    assert metrics["gate"] == pytest.approx(1.0)
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[-1.0]]))
    # r = 2, A = -1, tau_neg 1.05: sigmoid(1.05) = 0.740775, f = 4 / 1.05 * 0.740775 = 2.82200
    logp = torch.tensor([[math.log(2.0)]])
    loss, _ = sapo_loss(logp, torch.zeros(1, 1), -ONE, ONE, P(agg=SEQ), Chunk())
    assert float(loss.detach()) == pytest.approx(2.82200, abs=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_sapo_matches_loop(seed):
    logp, old, adv, mask = random_inputs(seed, scale=1.0)
    total, expected_grad = 0.0, torch.zeros(mask.shape)
    for i, tokens in enumerate(rows(mask)):
        for k in tokens:
            a, r = float(adv[i, k]), math.exp(float(logp[i, k].detach() - old[i, k]))
            tau = 0.5 if a > 0 else 2.0
            s = 1 / (1 + math.exp(-tau * (r - 1)))
            total += -(4 / tau) * s * a / len(tokens)
            expected_grad[i, k] = -a * 4 * s * (1 - s) * r / len(tokens) / mask.shape[0]
    loss, _ = sapo_loss(logp, old, adv, mask, P(tau_pos=0.5, tau_neg=2.0, agg=SEQ), Chunk())
    assert float(loss.detach()) == pytest.approx(total / mask.shape[0], rel=1e-5)
    torch.testing.assert_close(grad_of(loss, logp), expected_grad)


# -- Clip-Cov and KL-Cov -----------------------------------------------------------------------

# logp [0, -2, -4, -6] (mean -3) and A [1, 0.5, 0.5, -1] (mean 0.25): centred [3, 1, -1, -3]
# and [0.75, 0.25, 0.25, -1.25] -> Cov = [2.25, 0.25, -0.25, 3.75]
COV_LOGP = [[0.0, -2.0, -4.0, -6.0]]
COV_ADV = torch.tensor([[1.0, 0.5, 0.5, -1.0]])
COV_MASK = torch.ones(1, 4, dtype=torch.long)


def test_token_covariance_hand_example():
    cov = token_covariance(torch.tensor(COV_LOGP), COV_ADV, COV_MASK)
    torch.testing.assert_close(cov, torch.tensor([[2.25, 0.25, -0.25, 3.75]]))


def test_clip_cov_detaches_covariance_tokens_outside_the_ppo_clip():
    # tokens 0 and 3 have 1 < Cov < 5; token 0's ratio 1.5 with A = 1 is PPO-clipped, so only
    # token 3 is detached. Ratio 0.5 * 4 tokens = 2 picks. Token 0 (clipped) and 3 get no
    # gradient; tokens 1, 2 (ratio 1): -A / 4 = -0.125.
    logp = torch.tensor(COV_LOGP, requires_grad=True)
    old = torch.tensor([[-math.log(1.5), -2.0, -4.0, -6.0]])
    loss, metrics = clip_cov_loss(logp, old, COV_ADV, COV_MASK, P(cov_ratio=0.5), Chunk())
    # the value is not changed by detaching: (-1.2 - 0.5 - 0.5 + 1) / 4 = -0.3
    assert float(loss.detach()) == pytest.approx(-0.3)
    assert metrics["cov_frac"] == 0.25
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[0.0, -0.125, -0.125, 0.0]]))


def test_clip_cov_draws_the_ratio_of_candidates_at_random():
    # old = logp: no PPO clip; candidates 0 and 3, one pick (ratio 0.25 * 4): exactly one of
    # them loses its gradient, the same one for the same generator seed
    logp = torch.tensor(COV_LOGP, requires_grad=True)
    picks = []
    for seed in (0, 0, 1, 2, 3):
        loss, _ = clip_cov_loss(
            logp,
            torch.tensor(COV_LOGP),
            COV_ADV,
            COV_MASK,
            P(cov_ratio=0.25),
            Chunk(generator=torch.Generator().manual_seed(seed)),
        )
        grad = grad_of(loss, logp)[0]
        assert grad[1] == grad[2] == -0.125
        assert (grad[0] == 0) + (grad[3] == 0) == 1
        picks.append(int(grad[3] == 0))
    assert picks[0] == picks[1]


@pytest.mark.parametrize("seed", [0, 1])
def test_clip_cov_matches_loop(seed):
    # ratio 1.0: every candidate is picked, so the result is deterministic
    logp, old, adv, mask = random_inputs(seed)
    adv = adv * 6  # spread covariances over the (1, 5) band
    cells = [(i, k) for i, tokens in enumerate(rows(mask)) for k in tokens]
    mean_logp = sum(float(logp[c].detach()) for c in cells) / len(cells)
    mean_adv = sum(float(adv[c]) for c in cells) / len(cells)
    total, expected_grad, picked = 0.0, torch.zeros(mask.shape), 0
    for c in cells:
        a, r = float(adv[c]), math.exp(float(logp[c].detach() - old[c]))
        unclipped, clipped = -a * r, -a * min(max(r, 0.8), 1.2)
        total += max(unclipped, clipped)
        cov = (float(logp[c].detach()) - mean_logp) * (a - mean_adv)
        if clipped > unclipped:
            continue
        if 1.0 < cov < 5.0:
            picked += 1
            continue
        expected_grad[c] = -a * r / len(cells)
    loss, metrics = clip_cov_loss(logp, old, adv, mask, P(cov_ratio=1.0), Chunk())
    assert picked > 0
    assert float(loss.detach()) == pytest.approx(total / len(cells), rel=1e-5)
    assert metrics["cov_frac"] == pytest.approx(picked / len(cells))
    torch.testing.assert_close(grad_of(loss, logp), expected_grad)


def test_kl_cov_hand_example():
    # top-1 Cov is token 3 (3.75). Its log-ratio -0.2: r = exp(-0.2) = 0.81873; others r = 1.
    # token losses -A r: [-1, -0.5, -0.5, 0.81873], + |l| = 0.2 on token 3 -> sum -0.98127,
    # mean -0.24532. Token 3's gradient: (-A r + sign(l)) / 4 = (0.81873 - 1) / 4 = -0.04532
    logp = torch.tensor(COV_LOGP, requires_grad=True)
    old = torch.tensor([[0.0, -2.0, -4.0, -5.8]])
    loss, metrics = kl_cov_loss(logp, old, COV_ADV, COV_MASK, P(cov_ratio=0.25), Chunk())
    assert float(loss.detach()) == pytest.approx(-0.24532, abs=1e-5)
    assert metrics["cov_frac"] == 0.25
    expected = torch.tensor([[-1.0, -0.5, -0.5, math.exp(-0.2) - 1.0]]) / 4
    torch.testing.assert_close(grad_of(loss, logp), expected)


@pytest.mark.parametrize("seed", [0, 1])
def test_kl_cov_matches_loop(seed):
    logp, old, adv, mask = random_inputs(seed)
    cells = [(i, k) for i, tokens in enumerate(rows(mask)) for k in tokens]
    mean_logp = sum(float(logp[c].detach()) for c in cells) / len(cells)
    mean_adv = sum(float(adv[c]) for c in cells) / len(cells)
    by_cov = sorted(
        cells, key=lambda c: -(float(logp[c].detach()) - mean_logp) * (float(adv[c]) - mean_adv)
    )
    top = set(by_cov[: int(0.2 * len(cells))])
    total = 0.0
    for c in cells:
        log_ratio = float(logp[c].detach() - old[c])
        total += -float(adv[c]) * math.exp(log_ratio) + (0.5 * abs(log_ratio) if c in top else 0)
    loss, _ = kl_cov_loss(logp, old, adv, mask, P(cov_ratio=0.2, cov_kl_coef=0.5), Chunk())
    assert float(loss.detach()) == pytest.approx(total / len(cells), rel=1e-5)


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


ROLLOUT_SHIFT = torch.tensor([[100.0, 0.0, 0.0, 0.0], [-100.0, 0.0, 0.0, 0.0]] * 3)
LOSSES = {
    "ppo": lambda lp, o, a, m: ppo_loss(lp, o, a, m, P(clip_high=0.28, dual_clip=0.0), Chunk())[0],
    "ppo_dual_clip": lambda lp, o, a, m: ppo_loss(lp, o, a, m, P(dual_clip=3.0), Chunk())[0],
    "ppo_tis": lambda lp, o, a, m: ppo_loss(
        lp, o, a, m, NO_DUAL, Chunk(token_weights=tis_weights(o, o + ROLLOUT_SHIFT, cap=2.0))
    )[0],
    "gspo": lambda lp, o, a, m: gspo_loss(lp, o, a, m, GSPO, Chunk())[0],
    "cispo": lambda lp, o, a, m: cispo_loss(lp, o, a, m, P(clip_low=0.2, clip_high=0.28), Chunk())[
        0
    ],
    "gpg": lambda lp, o, a, m: gpg_loss(lp, o, a, m, P(), Chunk())[0],
    "gmpo": lambda lp, o, a, m: gmpo_loss(lp, o, a, m, GMPO, Chunk())[0],
    "sapo": lambda lp, o, a, m: sapo_loss(lp, o, a, m, P(agg=SEQ), Chunk())[0],
    "clip_cov": lambda lp, o, a, m: clip_cov_loss(lp, o, a, m, P(cov_ratio=0.5), Chunk())[0],
    "kl_cov": lambda lp, o, a, m: kl_cov_loss(lp, o, a, m, P(cov_ratio=0.5), Chunk())[0],
    **{
        f"kl_{kind}": lambda lp, o, a, m, kind=kind: ops.agg_loss(ops.kl_estimate(lp, o, kind), m)
        for kind in ops.KL_KINDS
    },
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_extreme_log_ratios_give_finite_loss_and_gradients(name):
    logp, old, adv, mask = extreme_inputs()
    loss = LOSSES[name](logp, old, adv, mask)
    assert torch.isfinite(loss), f"{name}: loss {float(loss.detach())}"
    grad = grad_of(loss, logp)
    assert torch.isfinite(grad).all(), f"{name}: gradient {grad}"


def test_extreme_token_leaves_the_others_gradient_intact():
    # PPO: the ordinary tokens (ratio near 1, unclipped) still get -A r / tokens
    logp, old, adv, mask = extreme_inputs()
    loss, _ = ppo_loss(logp, old, adv, mask, NO_DUAL, Chunk())
    grad = grad_of(loss, logp)
    ratio = torch.exp(logp.detach()[:, 1:3] - old[:, 1:3])
    torch.testing.assert_close(grad[:, 1:3], -adv[:, 1:3] * ratio / int(mask.sum()))


# -- micro-batches -----------------------------------------------------------------------------

CHUNKED = {
    "gspo": lambda lp, o, a, m, **n: gspo_loss(lp, o, a, m, P(agg=SEQ), Chunk(**n))[0],
    "cispo": lambda lp, o, a, m, **n: cispo_loss(lp, o, a, m, CISPO, Chunk(**n))[0],
    "gpg": lambda lp, o, a, m, **n: gpg_loss(lp, o, a, m, P(agg="seq-mean-token-sum"), Chunk(**n))[
        0
    ],
    "gmpo": lambda lp, o, a, m, num_tokens, num_seqs: gmpo_loss(
        lp, o, a, m, GMPO, Chunk(num_seqs=num_seqs)
    )[0],
    "sapo": lambda lp, o, a, m, **n: sapo_loss(lp, o, a, m, P(agg=SEQ), Chunk(**n))[0],
}


@pytest.mark.parametrize("name", sorted(CHUNKED))
def test_micro_batch_losses_sum_to_full_batch_loss(name):
    # with the whole batch's token and row counts, the chunks' losses add up to the batch's
    logp, old, adv, mask = random_inputs(3)
    counts = {"num_tokens": mask.sum(), "num_seqs": mask.shape[0]}
    full = CHUNKED[name](logp, old, adv, mask, num_tokens=None, num_seqs=None)
    parts = sum(
        CHUNKED[name](logp[i : i + 4], old[i : i + 4], adv[i : i + 4], mask[i : i + 4], **counts)
        for i in range(0, mask.shape[0], 4)
    )
    torch.testing.assert_close(parts, full)
