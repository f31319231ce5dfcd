"""Advantage estimators against hand-computed small cases (masks and process rewards included)."""

import numpy as np
import pytest
from support.synthetic import make_group, make_trajectory

from agentrl.common.trajectory import TrajectoryGroup
from agentrl.learner.advantages import AdvantageConfig, compute_advantages, filter_groups, gae
from agentrl.learner.rewards import (
    RewardSchedule,
    RewardWeights,
    token_rewards,
    trajectory_return,
    turn_rewards,
)

# Layout used below: T = 6; tokens 0,1 prompt; 2,3 action (turn 0); 4 observation; 5 action (turn 1).
LAYOUT = dict(prompt_len=2, turns=[(2, 1), (1, 0)])
ACTION_MASK = np.array([0, 0, 1, 1, 0, 1], dtype=bool)


def _traj(task_reward, process=None, index=0, status="ok", group_id="g"):
    return make_trajectory(**LAYOUT, task_reward=task_reward, process_rewards=process, sample_index=index,
                           status=status, group_id=group_id)


def _group(trajs, group_id="g"):
    return TrajectoryGroup(group_id, "t", trajs)


def test_token_rewards_sit_at_turn_boundaries_with_weights():
    traj = _traj(1.0, process=[{"valid_call": 0.5, "useful": 0.25}, {}])
    rewards = token_rewards(traj, RewardWeights(process=0.4, task=2.0))
    # turn 0 ends at token 3: 0.4 * 0.75 = 0.3; the task reward 2.0 * 1.0 lands on the last action token 5.
    np.testing.assert_allclose(rewards, [0, 0, 0, 0.3, 0, 2.0], atol=1e-7)


def test_grpo_std_normalised_and_masked():
    group = _group([_traj(r, index=i) for i, r in enumerate([1.0, 0.0, 0.0, 1.0])])
    advs = compute_advantages([group], RewardWeights(), AdvantageConfig("grpo"))[0]
    # mean 0.5, sample std sqrt(1/3) = 0.57735 -> +-0.866025
    for adv, sign in zip(advs, [1, -1, -1, 1], strict=True):
        np.testing.assert_allclose(adv[ACTION_MASK], sign * 0.8660254, atol=1e-5)
        assert (adv[~ACTION_MASK] == 0).all()


def test_grpo_includes_weighted_process_rewards():
    group = _group([_traj(1.0, process=[{"v": 1.0}, {}], index=0), _traj(1.0, index=1)])
    advs = compute_advantages([group], RewardWeights(process=0.5, task=1.0), AdvantageConfig("grpo", std_normalise=False))[0]
    # returns 1.5 and 1.0 -> mean 1.25 -> +0.25 / -0.25
    np.testing.assert_allclose(advs[0][ACTION_MASK], 0.25, atol=1e-6)
    np.testing.assert_allclose(advs[1][ACTION_MASK], -0.25, atol=1e-6)


def test_dr_grpo_and_rloo():
    group = _group([_traj(r, index=i) for i, r in enumerate([1.0, 0.0, 0.0])])
    dr = compute_advantages([group], RewardWeights(), AdvantageConfig("dr_grpo"))[0]
    np.testing.assert_allclose([a[5] for a in dr], [2 / 3, -1 / 3, -1 / 3], atol=1e-6)
    rloo = compute_advantages([group], RewardWeights(), AdvantageConfig("rloo"))[0]
    np.testing.assert_allclose([a[5] for a in rloo], [1.0, -0.5, -0.5], atol=1e-6)
    assert all((a[~ACTION_MASK] == 0).all() for a in dr + rloo)


def test_reinforce_pp_return_to_go_credits_only_earlier_actions_then_whitens():
    traj = _traj(1.0, process=[{"v": 0.5}, {}])
    cfg = AdvantageConfig("reinforce_pp", gamma=0.5, eps=0.0)
    adv = compute_advantages([_group([traj])], RewardWeights(process=0.4, task=1.0), cfg)[0][0]
    # rewards [0,0,0,0.2,0,1]; G over actions (gamma 0.5, observation skipped): t5=1.0, t3=0.7, t2=0.35;
    # whitened over those three: mean 0.683333, std 0.265623.
    np.testing.assert_allclose(adv[ACTION_MASK], [-1.2549116, 0.0627456, 1.1921660], atol=1e-5)
    assert (adv[~ACTION_MASK] == 0).all()


def test_reinforce_pp_baseline_subtracts_group_mean():
    group = _group([_traj(1.0, index=0), _traj(0.0, index=1)])
    advs = compute_advantages([group], RewardWeights(), AdvantageConfig("reinforce_pp_baseline", eps=0.0))[0]
    # G - 0.5 = +-0.5 on all 3 action tokens; whitening: mean 0, std 0.5 -> +-1
    np.testing.assert_allclose(advs[0][ACTION_MASK], 1.0, atol=1e-6)
    np.testing.assert_allclose(advs[1][ACTION_MASK], -1.0, atol=1e-6)


def test_gae_over_action_tokens_skips_observations():
    traj = _traj(1.0, process=[{"v": 0.5}, {}])
    rewards = token_rewards(traj, RewardWeights(process=0.4, task=1.0))
    values = np.array([9.0, 9.0, 0.5, 0.6, 9.0, 0.8], dtype=np.float32)  # 9.0 where no decision is made
    adv, ret = gae(rewards, values, traj.is_action, gamma=1.0, lam=0.5)
    # t5: 1 - .8 = .2; t3: .2 + .8 - .6 = .4 -> .4 + .5*.2 = .5; t2: .6 - .5 = .1 -> .1 + .5*.5 = .35
    np.testing.assert_allclose(adv, [0, 0, 0.35, 0.5, 0, 0.2], atol=1e-6)
    np.testing.assert_allclose(ret, [0, 0, 0.85, 1.1, 0, 1.0], atol=1e-6)
    via_api = compute_advantages([_group([traj])], RewardWeights(process=0.4, task=1.0),
                                 AdvantageConfig("gae", lam=0.5), values=[[values]])[0][0]
    np.testing.assert_allclose(via_api, adv)


def test_gae_needs_values():
    with pytest.raises(ValueError, match="values"):
        compute_advantages([_group([_traj(1.0)])], RewardWeights(), AdvantageConfig("gae"))


def test_filter_drops_failed_samples_small_groups_and_equal_rewards():
    mixed = _group([_traj(1.0, index=0), _traj(0.0, index=1), _traj(0.0, index=2, status="failed")], "mixed")
    equal = make_group("equal", [1.0, 1.0, 1.0])
    lonely = _group([_traj(1.0, index=0), _traj(0.0, index=1, status="failed")], "lonely")
    out = filter_groups([mixed, equal, lonely], RewardWeights(), AdvantageConfig("grpo", dynamic_sampling=True))
    assert [g.group_id for g in out.groups] == ["mixed"]
    assert len(out.groups[0].trajectories) == 2
    assert out.num_failed_samples == 2
    assert out.dropped_equal_rewards == ["equal"]
    assert out.dropped_too_small == ["lonely"]
    without = filter_groups([equal], RewardWeights(), AdvantageConfig("grpo", dynamic_sampling=False))
    assert [g.group_id for g in without.groups] == ["equal"]


def test_config_rejects_unknown_estimator():
    with pytest.raises(ValueError, match="Input should be 'grpo'"):
        AdvantageConfig("ppo2")  # type: ignore[arg-type]


def test_reward_schedule_weights_and_the_one_weighting():
    """The schedule moves linearly and stays; turn rewards, the return and the token rewards are
    the same weighting (they all derive from `turn_rewards`)."""
    schedule = RewardSchedule(0.7, 0.3, 0.3, 0.7, num_steps=100)
    assert schedule.weights(0) == RewardWeights(0.7, 0.3)
    assert schedule.weights(50) == pytest.approx(RewardWeights(0.5, 0.5))
    assert schedule.weights(500) == pytest.approx(RewardWeights(0.3, 0.7))
    traj = _traj(1.0, process=[{"valid_call": 0.1, "tool_success": 0.1}, {"malformed_call": -0.2}])
    w = schedule.weights(0)
    assert turn_rewards(traj, w) == pytest.approx([0.7 * 0.2, 0.7 * -0.2 + 0.3 * 1.0])
    assert trajectory_return(traj, w) == pytest.approx(0.3)
    assert token_rewards(traj, w).sum() == pytest.approx(trajectory_return(traj, w))
