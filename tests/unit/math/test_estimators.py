"""Group estimators of flowrl.math.estimators (pass@k, OPO, GPG): hand-derived examples, and parity
with plain loops: pass@k against an enumeration of every k-subset of each group."""

import itertools
import statistics

import pytest
import torch

from flowrl.math.estimators import gpg_advantages, opo_advantages, passk_advantages

# -- pass@k ------------------------------------------------------------------------------------


def test_passk_hand_example():
    # group of 4, one right, k = 2. Of the C(4, 2) = 6 pairs, 3 hold the right answer (reward
    # 1), 3 do not (0): mean 0.5, std 0.5, normalised +1 / -1. The right answer is in 3 pairs,
    # all +1 -> A = 1. A wrong one is in 3 pairs: 1 with the right answer (+1), 2 without
    # (-1) -> A = -1/3. Closed form: A_neg = (1 - 0.5 - C(2, 1) / C(3, 1)) / 0.5 = -1/3.
    adv = passk_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.zeros(4), k=2)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))


def test_passk_groups_without_spread_get_zero():
    # all right; all wrong; and one wrong of three with k = 2 (every pair passes)
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    uid = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    assert torch.equal(passk_advantages(scores, uid, k=2), torch.zeros(7))


def test_passk_k1_is_grpo_with_population_std():
    # [1, 0, 0]: mean 1/3, population std sqrt(2)/3 -> (1 - 1/3) / 0.4714 = 1.41421, -0.70711
    adv = passk_advantages(torch.tensor([1.0, 0.0, 0.0]), torch.zeros(3), k=1)
    torch.testing.assert_close(adv, torch.tensor([1.41421, -0.70711, -0.70711]))


def test_passk_rejects_non_binary_scores_and_small_groups():
    with pytest.raises(ValueError, match="binary"):
        passk_advantages(torch.tensor([0.5, 1.0]), torch.zeros(2), k=1)
    with pytest.raises(ValueError, match="at least 3"):
        passk_advantages(torch.tensor([0.0, 1.0]), torch.zeros(2), k=3)


def reference_passk(scores, uid, k):
    """For each row: the mean over the k-subsets of its group that contain it of the subset's
    pass@k reward (max), normalised by the mean and population std over all subsets."""
    out = []
    for i in range(len(scores)):
        members = [j for j in range(len(scores)) if uid[j] == uid[i]]
        subsets = list(itertools.combinations(members, k))
        rewards = [max(float(scores[j]) for j in s) for s in subsets]
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        if std == 0:
            out.append(0.0)
            continue
        mine = [(r - mean) / std for s, r in zip(subsets, rewards, strict=True) if i in s]
        out.append(statistics.fmean(mine))
    return torch.tensor(out)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_passk_matches_subset_enumeration(seed, k):
    g = torch.Generator().manual_seed(seed)
    uid = torch.tensor([0] * 4 + [1] * 5 + [2] * 6 + [3] * 3)
    scores = (torch.rand(len(uid), generator=g) < 0.4).float()
    torch.testing.assert_close(passk_advantages(scores, uid, k), reference_passk(scores, uid, k))


# -- OPO ---------------------------------------------------------------------------------------


def test_opo_hand_example():
    # group [1, 0] with lengths [1, 3]: b = (1 * 1 + 3 * 0) / 4 = 0.25 -> [0.75, -0.25];
    # a group of one: b = its own score -> 0
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 1, 0]])
    adv = opo_advantages(torch.tensor([1.0, 0.0, 5.0]), torch.tensor([0, 0, 1]), mask)
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, 0.0]))


@pytest.mark.parametrize("seed", [0, 1])
def test_opo_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    uid = torch.randint(0, 4, (12,), generator=g)
    scores = torch.randn(12, generator=g)
    mask = (torch.arange(6)[None] < torch.randint(1, 7, (12, 1), generator=g)).long()
    expected = []
    for i in range(12):
        group = [j for j in range(12) if uid[j] == uid[i]]
        lengths = {j: int(mask[j].sum()) for j in group}
        baseline = sum(lengths[j] * float(scores[j]) for j in group) / sum(lengths.values())
        expected.append(float(scores[i]) - baseline)
    torch.testing.assert_close(opo_advantages(scores, uid, mask), torch.tensor(expected))


# -- GPG ---------------------------------------------------------------------------------------


def test_gpg_hand_example():
    # groups [1, 0] and [1, 1]: B = 4 rows, M = 2 in the uniform group -> alpha = 4 / 2 = 2;
    # first group centred [0.5, -0.5] -> [1, -1]; the uniform group -> 0
    adv = gpg_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("scale_by_std", [False, True])
def test_gpg_matches_loop(seed, scale_by_std):
    g = torch.Generator().manual_seed(seed)
    uid = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3])
    scores = torch.randint(0, 3, (9,), generator=g).float()
    groups = {int(u): [float(scores[j]) for j in range(9) if uid[j] == u] for u in uid}
    valid = {u: len(set(s)) > 1 for u, s in groups.items()}
    alpha = 9 / max(sum(len(s) for u, s in groups.items() if valid[u]), 1)
    expected = []
    for i in range(9):
        group = groups[int(uid[i])]
        if not valid[int(uid[i])]:
            expected.append(0.0)
            continue
        value = float(scores[i]) - statistics.fmean(group)
        if scale_by_std:
            value /= statistics.stdev(group) + 1e-6
        expected.append(alpha * value)
    torch.testing.assert_close(gpg_advantages(scores, uid, scale_by_std), torch.tensor(expected))


def test_group_statistics_over_episodes_held_in_several_rows():
    """An episode in k rows, each with its score and share 1/k: GRPO's and RLOO's advantages
    are those of the episodes as one row each (mean, unbiased std, leave-one-out)."""
    import torch

    from flowrl.math import estimators

    episodes = torch.tensor([1.0, 0.0, 0.5, 0.25, 2.0])
    uid = torch.tensor([0, 0, 0, 1, 1])
    k = 3
    rows = episodes.repeat_interleave(k)
    rows_uid = uid.repeat_interleave(k)
    share = torch.full((len(rows),), 1.0 / k)
    for fn in (estimators.group_advantages, estimators.leave_one_out_advantages):
        once = fn(episodes, uid)
        spread = fn(rows, rows_uid, share=share)
        torch.testing.assert_close(spread, once.repeat_interleave(k))
        assert not torch.allclose(fn(rows, rows_uid), once.repeat_interleave(k))  # unweighted
    # a group of one episode in k rows still gets 0
    alone = estimators.group_advantages(
        torch.ones(k), torch.zeros(k, dtype=torch.long), share=torch.full((k,), 1 / k)
    )
    assert alone.tolist() == [0.0] * k


def test_one_row_per_episode_estimators_refuse_shared_episodes():
    import pytest

    from flowrl.math.estimators import refuse_shared_episodes

    refuse_shared_episodes({"scores": 1}, "passk")  # one row per episode: fine
    with pytest.raises(ValueError, match=r"advantage.passk .*max_segments > 1.*advantage.grpo"):
        refuse_shared_episodes({"episode_share": 1}, "passk")
