"""GRPO math: advantages, the dynamic-sampling filter and every option of the reference loss,
against values computed by hand."""

import math

from types import SimpleNamespace

import numpy as np
import pytest

from common.grpo import (LossConfig, dynamic_sampling_keep, group_advantages, kl_penalty,
                         policy_loss)


def test_group_advantages_by_hand():
    r = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]  # groups of 3: [1, 0, 0], [1, 1, 1]
    adv = group_advantages(r, 3)
    mean, std = 1 / 3, math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    np.testing.assert_allclose(adv[:3], [(1 - mean) / (std + 1e-6), -mean / (std + 1e-6),
                                         -mean / (std + 1e-6)])
    assert np.all(adv[3:] == 0.0)
    np.testing.assert_allclose(group_advantages(r, 3, normalize_std=False)[:3],
                               [2 / 3, -1 / 3, -1 / 3])


def test_equal_fractional_rewards_give_exact_zero():
    r = np.full(8, 0.9, np.float32)  # the anchor's spurious-gradient case
    assert np.all(group_advantages(r, 8) == 0.0)
    assert np.all(group_advantages(r, 8, normalize_std=False) == 0.0)


def test_group_advantages_bad_shapes():
    with pytest.raises(ValueError):
        group_advantages([1.0, 0.0, 1.0], 2)
    assert np.all(group_advantages([1.0, 0.0], 1) == 0.0)


def test_dynamic_sampling_keep():
    keep = dynamic_sampling_keep([1, 1, 0, 1, 0, 0, 0.5, 0.5], 2)
    assert keep.tolist() == [False, False, True, True, False, False, False, False]


# One sequence of 4 tokens, the last masked out; values chosen so every branch is hit.
LOGP = np.array([-1.0, -0.5, -2.0, -3.0])
OLD = np.array([-1.5, -0.4, -1.0, -3.0])
MASK = np.array([1, 1, 1, 0])


def pg_by_hand(adv, lo=0.2, hi=0.28, dual=None):
    out = []
    for lp, old in zip(LOGP, OLD):
        rho = math.exp(lp - old)
        v = max(-adv * rho, -adv * min(max(rho, 1 - lo), 1 + hi))
        if dual is not None and adv < 0:
            v = min(v, -dual * adv)
        out.append(v)
    return np.array(out)


@pytest.mark.parametrize("adv", [1.5, -0.7])
def test_clipped_surrogate_token_mean(adv):
    loss, m = policy_loss(LOGP, OLD, np.full(4, adv), MASK)
    assert loss == pytest.approx(pg_by_hand(adv)[:3].sum() / 3, rel=1e-12)
    rho = np.exp(LOGP - OLD)[:3]  # 1.65 (clipped for A>0), 0.905, 0.368 (clipped for A<0)
    expected_clip = np.mean(rho > 1.28) if adv > 0 else np.mean(rho < 0.8)
    assert m["clip_frac"] == pytest.approx(expected_clip)
    assert m["approx_kl"] == pytest.approx(np.mean(rho - 1 - np.log(rho)))


def test_dual_clip_caps_negative_advantages():
    adv = -2.0
    cfg = LossConfig(dual_clip=1.5)
    loss, _ = policy_loss(LOGP, OLD, np.full(4, adv), MASK, cfg)
    # token 0: rho = e^0.5 = 1.65, -A*rho = 3.30 > 1.5 * 2 = 3.0, so the dual clip binds
    assert pg_by_hand(adv, dual=1.5)[0] == pytest.approx(3.0)
    assert loss == pytest.approx(pg_by_hand(adv, dual=1.5)[:3].sum() / 3)
    assert loss < policy_loss(LOGP, OLD, np.full(4, adv), MASK)[0]


@pytest.mark.parametrize("est,fn", [
    ("k1", lambda d: d), ("k2", lambda d: d * d / 2), ("k3", lambda d: math.exp(-d) - 1 + d)])
def test_kl_estimators(est, fn):
    ref = np.array([-1.2, -0.9, -2.5, 0.0])
    cfg = LossConfig(kl_coef=0.1, kl_estimator=est)
    loss, m = policy_loss(LOGP, OLD, np.full(4, 1.0), MASK, cfg, ref_logp=ref)
    kl = np.array([fn(a - b) for a, b in zip(LOGP, ref)])
    assert loss == pytest.approx((pg_by_hand(1.0) + 0.1 * kl)[:3].sum() / 3)
    assert m["kl"] == pytest.approx(kl[:3].mean())


def test_kl_is_clamped():
    assert kl_penalty(np.array([0.0]), np.array([50.0]), "k3")[0] == 10.0
    assert kl_penalty(np.array([50.0]), np.array([0.0]), "k1")[0] == 10.0
    assert kl_penalty(np.array([0.0]), np.array([50.0]), "k1")[0] == -10.0


def test_truncated_importance_sampling():
    rollout = np.array([-1.0, -0.5, -2.0, 0.0])  # w = exp(old - rollout) = e^-0.5, e^0.1, e^1 -> 2
    cfg = LossConfig(tis_cap=2.0)
    loss, m = policy_loss(LOGP, OLD, np.full(4, 1.0), MASK, cfg, rollout_logp=rollout)
    w = np.minimum(np.exp(OLD - rollout), 2.0)
    assert w[2] == 2.0
    assert loss == pytest.approx((pg_by_hand(1.0) * w)[:3].sum() / 3)
    assert m["tis_mean"] == pytest.approx(w[:3].mean())
    with pytest.raises(ValueError):
        policy_loss(LOGP, OLD, np.ones(4), MASK, cfg)


def test_aggregations_padded_and_packed_agree():
    rng = np.random.default_rng(0)
    lp, old = rng.normal(-1, 0.3, (2, 5)), rng.normal(-1, 0.3, (2, 5))
    adv = np.array([[1.0] * 5, [-0.5] * 5])
    mask = np.array([[0, 1, 1, 1, 1], [0, 0, 1, 0, 0]])
    per = np.maximum(-adv * np.exp(lp - old),
                     -adv * np.clip(np.exp(lp - old), 0.8, 1.28))
    tok, _ = policy_loss(lp, old, adv, mask)
    assert tok == pytest.approx((per * mask).sum() / 5)
    seq, _ = policy_loss(lp, old, adv, mask, LossConfig(agg="seq-mean-token-mean"))
    assert seq == pytest.approx(((per[0] * mask[0]).sum() / 4 + per[1, 2]) / 2)
    assert seq != pytest.approx(tok)
    # the same tokens packed into one row with sequence ids
    packed, _ = policy_loss(lp.reshape(-1), old.reshape(-1), adv.reshape(-1),
                            mask.reshape(-1), LossConfig(agg="seq-mean-token-mean"),
                            seq_ids=np.repeat([7, 3], 5))
    assert packed == pytest.approx(seq)


def test_micro_batches_sum_to_full_batch_with_global_denominators():
    rng = np.random.default_rng(1)
    lp, old = rng.normal(-1, 0.3, (4, 6)), rng.normal(-1, 0.3, (4, 6))
    adv = np.repeat(rng.normal(0, 1, (4, 1)), 6, axis=1)
    mask = (rng.random((4, 6)) > 0.3).astype(float)
    for agg in ("token-mean", "seq-mean-token-mean"):
        cfg = LossConfig(agg=agg)
        full, _ = policy_loss(lp, old, adv, mask, cfg)
        parts = sum(policy_loss(lp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], cfg,
                                n_tokens=mask.sum(), n_seqs=4)[0] for i in (0, 2))
        assert parts == pytest.approx(full)


def test_advantage_sign_matters():
    adv = np.full(4, 1.0)
    lp = LOGP + 0.01  # raising the log-probs lowers the loss only when A > 0
    assert policy_loss(lp, OLD, adv, MASK)[0] < policy_loss(LOGP, OLD, adv, MASK)[0]
    assert policy_loss(lp, OLD, -adv, MASK)[0] > policy_loss(LOGP, OLD, -adv, MASK)[0]


def test_empty_mask_gives_zero_loss():
    assert policy_loss(LOGP, OLD, np.ones(4), np.zeros(4))[0] == 0.0


@pytest.mark.parametrize("kw", [dict(agg="sum"), dict(kl_estimator="k4"), dict(dual_clip=1.0),
                                dict(tis_cap=0.0), dict(clip_low=-0.1)])
def test_bad_loss_options(kw):
    with pytest.raises(ValueError):
        LossConfig(**kw)


def test_episode_advantages_skip_invalid_and_filter_equal_groups():
    from common.grpo import episode_advantages
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    groups = np.array([0, 0, 0, 0, 1, 1, 2, 2])
    valid = np.array([True, True, True, False, True, True, True, False])
    adv, keep = episode_advantages(rewards, groups, valid)
    np.testing.assert_allclose(adv[:3], group_advantages(rewards[:3], 3))
    assert adv[3] == 0 and not keep[3]
    assert keep.tolist() == [True, True, True, False, False, False, False, False]
    _, keep = episode_advantages(rewards, groups, valid, filter_equal=False)
    assert keep.tolist() == [True, True, True, False, True, True, True, False]


def test_turn_advantages_rank_each_turn_among_the_episodes_that_reached_it():
    """One group of five: turn 1 of every valid episode is scored against the whole group (as
    `episode_advantages`), turn 2 against the three that reached it, turn 3 against the two,
    all on the whole group's scale; the aborted one and the turns an episode never played get
    0. Another group, whose turn 2 only one episode reached, gives that turn 0."""
    from common.grpo import episode_advantages, turn_advantages
    rewards = np.array([1.0, 0.5, 0.25, 0.0, 0.0, 1.0, 0.0])
    groups = np.array([0, 0, 0, 0, 0, 1, 1])
    valid = np.array([True, True, True, True, False, True, True])
    turns = np.array([1, 2, 3, 3, 3, 1, 2])
    adv = turn_advantages(rewards, groups, valid, turns)
    assert adv.shape == (7, 3)
    np.testing.assert_allclose(adv[:, 0], episode_advantages(rewards, groups, valid)[0])
    # group 0's valid rewards 1, .5, .25, 0: std 0.426956. Turn 2: .5, .25, 0 around .25;
    # turn 3: .25, 0 around .125. Scaled by the turn's own spread (the estimator this
    # replaced) turn 3 would be +-0.707 and turn 2 +-1 whatever the rewards.
    np.testing.assert_allclose(adv[:4, 1], [0, 0.585540, 0, -0.585540], atol=1e-5)
    np.testing.assert_allclose(adv[:4, 2], [0, 0, 0.292770, -0.292770], atol=1e-5)
    assert not adv[4].any() and not adv[5:, 1:].any()
    unscaled = turn_advantages(rewards, groups, valid, turns, normalize_std=False)
    np.testing.assert_allclose(unscaled[1:4, 1], [0.25, 0.0, -0.25])


def test_a_turn_advantage_grows_with_the_reward_gap():
    """Two episodes reach turn 2 in each group; their turn-2 advantages are half their reward
    gap over the group's std, so a gap of 0.5 gives half the advantage of a gap of 1 (the
    per-turn spread would give both +-0.707)."""
    from common.grpo import turn_advantages
    rewards = np.array([1.0, 1.0, 0.0, 1.0, 0.5, 0.0])
    groups = np.array([0, 0, 0, 1, 1, 1])
    turns = np.array([1, 2, 2, 1, 2, 2])
    adv = turn_advantages(rewards, groups, np.ones(6, bool), turns)
    std = np.std([1.0, 1.0, 0.0], ddof=1), np.std([1.0, 0.5, 0.0], ddof=1)  # 0.57735, 0.5
    np.testing.assert_allclose(adv[1:3, 1], [0.5 / std[0], -0.5 / std[0]], atol=1e-5)
    np.testing.assert_allclose(adv[4:6, 1], [0.25 / std[1], -0.25 / std[1]], atol=1e-5)
    assert adv[1, 1] == pytest.approx(0.866024, abs=1e-5)
    assert adv[4, 1] == pytest.approx(0.5, abs=1e-5)


def test_an_aborted_episode_with_more_turns_than_any_valid_one_gets_zeros():
    """The columns cover every episode's turns, aborted ones included, so the per-token
    advantages of any trajectory can be read (an IndexError before: K counted valid ones)."""
    from common.batching import turn_token_advantages
    from common.grpo import turn_advantages
    adv = turn_advantages(np.array([1.0, 0.0, 0.0]), np.zeros(3, int),
                          np.array([True, True, False]), np.array([1, 2, 4]))
    assert adv.shape == (3, 4) and not adv[2].any()
    turns = [SimpleNamespace(start=2 * k, end=2 * k + 1) for k in range(4)]
    traj = SimpleNamespace(token_ids=np.zeros(12), turns=turns)
    assert not turn_token_advantages(traj, adv[2]).any()
