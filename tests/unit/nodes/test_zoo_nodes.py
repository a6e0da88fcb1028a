"""The nodes the shipped algorithm graphs need: DAPO's overlong penalty, token rewards without
a reference model, the pass@k / OPO / GPG advantage nodes, ReMax's reward-to-go, verl's
REINFORCE++-baseline, the adaptive KL controller's input, and verl's dual-clip default."""

import copy
from pathlib import Path

import pytest
import torch

from flowrl.engines import TrainEngine
from flowrl.hooks import CheckContext
from flowrl.math import estimators, ops
from flowrl.math.losses import LOSSES, Chunk
from flowrl.nodes.advantage import gpg, opo, passk, reinforce_pp
from flowrl.nodes.reward import kl_penalty, overlong, token_rewards
from flowrl.nodes.update import policy
from flowrl.protocol import DataProto
from flowrl.testing import assert_same, first_step, tiny_model, tiny_tokenizer, update_rows

ROOT = Path(__file__).resolve().parents[3]


def context(samples=4, prompts=2):
    return CheckContext("node", prompts * samples, samples, prompts, 1, ".")


def lengths_mask(lengths, t):
    return (torch.arange(t)[None] < torch.tensor(lengths)[:, None]).long()


# -- reward.overlong -----------------------------------------------------------------------


def test_overlong_penalty_hand_example():
    # L = 10, B = 4: no penalty up to 6 tokens, then -(|y| - 6) / 4, -1 at 10
    mask = lengths_mask([5, 6, 8, 10], 10)
    penalty = overlong.overlong_penalty(mask, max_len=10, buffer_len=4, penalty_factor=1.0)
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.5, -1.0]))
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    rows = DataProto.from_dict({"scores": scores, "response_mask": mask})
    out, metrics = overlong.run(rows, overlong.Params(max_len=10, buffer_len=4))
    torch.testing.assert_close(out["shaped_scores"], torch.tensor([1.0, 0.0, 0.5, 0.0]))
    assert metrics["penalised_fraction"] == 0.5


def test_overlong_penalty_matches_verls_formula():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 21, (32,), generator=g)
    mask = lengths_mask(lengths.tolist(), 20)
    got = overlong.overlong_penalty(mask, max_len=20, buffer_len=5, penalty_factor=0.7)
    for i, length in enumerate(lengths.tolist()):
        # verl: expected_len = max_resp_len - buffer; exceed = length - expected_len;
        # reward = min(-exceed / buffer * factor, 0)
        exceed = length - (20 - 5)
        assert float(got[i]) == pytest.approx(min(-exceed / 5 * 0.7, 0.0))


def test_overlong_buffer_must_fit_the_cap():
    assert overlong.check(overlong.Params(max_len=10, buffer_len=12), context())
    assert not overlong.check(overlong.Params(max_len=10, buffer_len=4), context())


# -- reward.token_rewards --------------------------------------------------------------------


def test_token_rewards_put_the_score_on_the_last_trained_token():
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    rewards = token_rewards.last_token_rewards(torch.tensor([2.0, 5.0, -1.0]), mask, scale=0.5)
    # row 0: the last 1 is at index 3 (after a hole); row 1 has no token: nothing
    expected = torch.tensor([[0, 0, 0, 1.0, 0], [0, 0, 0, 0, 0], [-0.5, 0, 0, 0, 0]])
    torch.testing.assert_close(rewards, expected)


def test_token_rewards_equal_a_kl_penalty_of_zero_without_the_log_prob_passes():
    g = torch.Generator().manual_seed(1)
    mask = lengths_mask([3, 5, 1, 4], 5)
    scores = torch.randn(4, generator=g)
    logprobs = torch.randn(4, 5, generator=g)
    reference, _ = kl_penalty.kl_token_rewards(scores, logprobs, logprobs * 2, mask, 0.0, "k1")
    torch.testing.assert_close(token_rewards.last_token_rewards(scores, mask), reference)


# -- advantage.passk / opo / gpg ----------------------------------------------------------------


@pytest.mark.parametrize(
    "node, estimate",
    [
        (passk, lambda s, u, m: estimators.passk_advantages(s, u, 2)),
        (opo, estimators.opo_advantages),
        (gpg, lambda s, u, m: estimators.gpg_advantages(s, u, False, 1e-6)),
    ],
)
def test_advantage_nodes_broadcast_their_estimator_over_trained_tokens(node, estimate):
    mask = lengths_mask([2, 3, 1, 3, 2, 1, 3, 3], 3)
    scores = torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 0])
    uid = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    rows = DataProto.from_dict({"scores": scores, "uid": uid, "response_mask": mask})
    params = node.Params(k=2) if node is passk else node.Params()
    out = node.run(rows, params)["advantages"]
    expected = estimate(scores, uid, mask)[:, None] * mask
    torch.testing.assert_close(out, expected)
    assert out.abs().sum() > 0


def test_passk_k_must_fit_the_samples():
    found = passk.check(passk.Params(k=5), context(samples=4))
    assert "k = 5 needs k <= the 4 samples" in found[0].message
    assert not passk.check(passk.Params(k=4), context(samples=4))


# -- advantage.remax -----------------------------------------------------------------------


def test_remax_reward_to_go_minus_the_greedy_score():
    # KL in the reward: -0.1 on every token, the score 1 on the last one; greedy scored 0.5
    rewards = torch.tensor([[-0.1, -0.1, 0.9, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv = estimators.remax_return_advantages(rewards, torch.tensor([0.5]), mask)
    # returns-to-go 0.7, 0.8, 0.9; minus 0.5
    torch.testing.assert_close(adv, torch.tensor([[0.2, 0.3, 0.4, 0.0]]))


def test_remax_with_only_the_score_is_the_outcome_form():
    mask = lengths_mask([3, 1, 4], 4)
    scores, greedy = torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0.0, 1.0, 0.5])
    rewards = token_rewards.last_token_rewards(scores, mask)
    torch.testing.assert_close(
        estimators.remax_return_advantages(rewards, greedy, mask),
        estimators.remax_advantages(scores, greedy, mask).float(),
    )


def test_remax_matches_verls_loop():
    g = torch.Generator().manual_seed(2)
    mask = lengths_mask([4, 2, 0, 5], 5)
    rewards, greedy = torch.randn(4, 5, generator=g), torch.randn(4, generator=g)
    expected = torch.zeros(4, 5)
    for i in range(4):
        for t in range(5):
            if mask[i, t]:
                to_go = sum(float(rewards[i, s]) for s in range(t, 5) if mask[i, s])
                expected[i, t] = to_go - float(greedy[i])
    torch.testing.assert_close(estimators.remax_return_advantages(rewards, greedy, mask), expected)


# -- advantage.reinforce_pp with baseline = "group" -----------------------------------------------


def verl_reinforce_pp_baseline(rewards, mask, uid):
    """verl's compute_reinforce_plus_plus_baseline_outcome_advantage, as a plain loop."""
    scores = (rewards * mask).sum(-1)
    groups = {}
    for i, u in enumerate(uid.tolist()):
        groups.setdefault(u, []).append(float(scores[i]))
    centred = torch.zeros(len(scores))
    for i, u in enumerate(uid.tolist()):
        mean = 0.0 if len(groups[u]) == 1 else sum(groups[u]) / len(groups[u])
        centred[i] = scores[i] - mean
    tiled = centred[:, None] * mask
    return ops.masked_whiten(tiled, mask) * mask


def test_reinforce_pp_baseline_keeps_a_lone_samples_total():
    # groups {0, 1} and {2}; totals 1, 0, 1: centred 0.5, -0.5, and the lone row keeps 1
    mask = torch.ones(3, 2, dtype=torch.long)
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 1.0]])
    rows = DataProto.from_dict(
        {"token_rewards": rewards, "response_mask": mask, "uid": torch.tensor([0, 0, 2])}
    )
    out = reinforce_pp.run(rows, reinforce_pp.Params(baseline="group"))
    centred = torch.tensor([0.5, -0.5, 1.0])[:, None].expand(3, 2)
    torch.testing.assert_close(out["advantages"], ops.masked_whiten(centred, mask))
    assert float(out["advantages"][2, 0]) > 0  # GRPO and RLOO would give it 0


@pytest.mark.parametrize("seed", [0, 1])
def test_reinforce_pp_baseline_matches_verl(seed):
    g = torch.Generator().manual_seed(seed)
    mask = lengths_mask(torch.randint(1, 6, (7,), generator=g).tolist(), 5)
    rewards = torch.randn(7, 5, generator=g)
    uid = torch.tensor([0, 0, 0, 1, 1, 2, 3])
    got = estimators.baseline_advantages(rewards, mask, uid)
    torch.testing.assert_close(got, verl_reinforce_pp_baseline(rewards, mask, uid))


def test_reinforce_pp_baseline_refuses_a_discount():
    found = reinforce_pp.check(reinforce_pp.Params(baseline="group", gamma=0.9), context())
    assert found and "does not discount" in found[0].message
    assert not reinforce_pp.check(reinforce_pp.Params(gamma=0.9), context())


# -- reward.kl_penalty's adaptive controller -------------------------------------------------


def test_adaptive_kl_controller_steers_the_per_token_mean_by_default():
    # k1 KL 0.5 per token; rows of 2 and 4 tokens: per-sequence sums 1 and 2 (mean 1.5), per
    # token mean 0.5. Target 0.25 per token: error clipped to +0.2, n / horizon = 2 / 10
    mask = lengths_mask([2, 4], 4)
    rows = DataProto.from_dict(
        {
            "scores": torch.zeros(2),
            "old_logprobs": torch.full((2, 4), -1.0),
            "ref_logprobs": torch.full((2, 4), -1.5),
            "response_mask": mask,
        }
    )
    params = kl_penalty.Params(kl_coef=0.1, controller="adaptive", target_kl=0.25, horizon=10)
    state = {}
    _, metrics = kl_penalty.run(rows, params, state)
    assert metrics["kl"] == pytest.approx(1.5) and metrics["kl_token_mean"] == pytest.approx(0.5)
    assert state["kl_coef"] == pytest.approx(0.1 * (1 + 0.2 * 2 / 10))
    # the same target per sequence (Ziegler's input): 1.5 / 0.25 - 1 clips to 0.2 too, but a
    # target of 3 nats per sequence now means "too little KL": beta shrinks
    seq = kl_penalty.Params(
        kl_coef=0.1, controller="adaptive", kl_input="seq-sum", target_kl=3.0, horizon=10
    )
    state = {}
    kl_penalty.run(rows, seq, state)
    assert state["kl_coef"] == pytest.approx(0.1 * (1 - 0.2 * 2 / 10))
    assert kl_penalty.Params().target_kl == 0.1  # verl's default, per token


# -- update.policy: verl's dual-clip and pg_clipfrac_lower ---------------------------------


def test_dual_clip_is_on_by_default_with_verls_c():
    # ratio e^2 ~ 7.4 on a negative advantage: the loss per token is bounded by -A c = 3
    logp, old = torch.zeros(1, 1), torch.full((1, 1), -2.0)
    adv, mask = torch.full((1, 1), -1.0), torch.ones(1, 1)
    ppo = LOSSES[policy.Params().loss].fn
    loss, rates = ppo(logp, old, adv, mask, policy.Params(), Chunk())
    assert float(loss) == pytest.approx(3.0) and rates["clip_frac_lower"] == 1.0
    off, _ = ppo(logp, old, adv, mask, policy.Params(dual_clip=0.0), Chunk())
    assert float(off) == pytest.approx(float(torch.exp(torch.tensor(2.0))))


def test_dual_clip_changes_nothing_in_an_on_policy_update():
    # grpo.toml's update (on_policy, one mini-batch): every ratio is 1, the bound never acts
    model = tiny_model(seed=0)
    with_c, _ = first_step(model, policy.PolicyUpdateWorker, policy.Params(on_policy=True))
    without, _ = first_step(
        model, policy.PolicyUpdateWorker, policy.Params(on_policy=True, dual_clip=0.0)
    )
    assert_same(with_c, without)


def test_update_reports_pg_clipfrac_lower():
    # old log-probs 2 nats below the policy's: ratio ~ 7.4 > 3 on every token, so the bound
    # binds on exactly the tokens of negative advantage
    model = tiny_model(seed=0)
    rows = update_rows()
    engine = TrainEngine(copy.deepcopy(model), tiny_tokenizer())
    now = engine.infer(rows)["logprobs"]
    shifted = DataProto.from_dict(
        {k: rows[k] for k in rows.keys() if k != "old_logprobs"} | {"old_logprobs": now - 2.0}
    )
    _, metrics = first_step(model, policy.PolicyUpdateWorker, policy.Params(), rows=shifted)
    mask, adv = rows["response_mask"], rows["advantages"]
    computed = (adv != 0).any(-1)  # zero-advantage rows are skipped
    negative = ((adv < 0) & mask.bool())[computed].sum() / mask[computed].sum()
    assert metrics["clip_frac_lower"] == pytest.approx(float(negative), rel=1e-5)
    assert metrics["clip_frac_lower"] > 0


# -- update.policy: loss-only params and the aggregation a loss's paper fixes ---------------


def grpo_with(tmp_path, *lines):
    """graphs/grpo.toml with `lines` added to its update_policy table, compiled (or refused)."""
    from flowrl.front.compiler import compile_file

    text = (ROOT / "graphs/grpo.toml").read_text()
    table = "[nodes.update_policy]\n"
    path = tmp_path / "g.toml"
    path.write_text(text.replace(table, table + "".join(f"{line}\n" for line in lines)))
    return path, lambda: compile_file(path)


def test_a_loss_only_param_under_another_loss_is_refused_naming_file_key_and_fix(tmp_path):
    from flowrl.errors import GraphErrors

    path, compile_it = grpo_with(tmp_path, 'loss = "gspo"', "tau_neg = 2.0", "cov_ratio = 0.1")
    with pytest.raises(GraphErrors) as refused:
        compile_it()
    text = str(refused.value)
    for key, readers in (("tau_neg", '"sapo"'), ("cov_ratio", '"clip_cov" or "kl_cov"')):
        line = next(x for x in text.splitlines() if f"{key} = " in x)
        assert line.strip().startswith(f"{path}: [nodes.update_policy]: ")
        assert f'read only by loss = {readers}; loss = "gspo" ignores it' in line
    assert "fix: remove tau_neg, or set loss to one that reads it" in text
    # the same params under the loss that reads them are fine
    grpo_with(tmp_path, 'loss = "kl_cov"', "cov_ratio = 0.1")[1]()


@pytest.mark.parametrize("loss", ["sapo", "gspo"])
def test_check_warns_when_sapo_or_gspo_does_not_average_per_sequence(tmp_path, loss):
    _, compile_it = grpo_with(tmp_path, f'loss = "{loss}"')
    warned = [w for w in compile_it().warnings if "agg" in w]
    assert warned == [
        f'[nodes.update_policy] loss = "{loss}" with agg = "token-mean": the paper and verl '
        'average it as agg = "seq-mean-token-mean"; set that to match them'
    ]
    _, compile_it = grpo_with(tmp_path, f'loss = "{loss}"', 'agg = "seq-mean-token-mean"')
    assert not [w for w in compile_it().warnings if "agg" in w]
