"""Batch preparation: the groups one step consumed -> the samples it trains on (pure: no I/O, no model).

In order: (1) off-policy control: trajectories whose oldest action token is more than
`staleness_bound` versions behind the learner are dropped (counted; the staleness histogram of all
action tokens is reported); (2) in RL, failed samples, too-small groups and (with dynamic sampling)
equal-reward groups are dropped (`advantages.filter_groups`); (3) advantages, computed once here
from the weighted rewards, except for GAE, whose advantages need the critic's values and are
computed in the trainer's step from the weighted token rewards prepared here. SFT data (gold
trajectories, version -1, sampled by no policy) skips (1)-(3).

Every consumed group ends up either kept (trained at this step) or in `rejected` with the reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from agentrl.common.trajectory import Trajectory, TrajectoryGroup
from agentrl.learner.advantages import AdvantageConfig, compute_advantages, filter_groups
from agentrl.learner.batching import Sample
from agentrl.learner.rewards import RewardWeights, token_rewards


@dataclass
class Batch:
    samples: list[Sample]
    kept_group_ids: list[str]
    rejected: dict[str, str] = field(default_factory=dict)
    """group id -> why it is not trained: "stale", "too_few_samples", "equal_rewards"."""
    report: dict[str, Any] = field(default_factory=dict)
    """Metrics for the step's line (staleness, drops)."""


def staleness_of(traj: Trajectory, version: int) -> np.ndarray:
    """Versions between `version` and the policy that sampled each action token."""
    return version - traj.policy_versions[traj.is_action.astype(bool)].astype(np.int64)


def prepare_batch(groups: list[TrajectoryGroup], *, version: int, mode: Literal["rl", "sft"],
                  staleness_bound: int | None, weights: RewardWeights, advantage: AdvantageConfig) -> Batch:
    if mode == "sft":
        samples = [Sample(g.group_id, t.sample_index, t, None) for g in groups for t in g.trajectories]
        return Batch(samples, [g.group_id for g in groups if g.trajectories],
                     {g.group_id: "stale" for g in groups if not g.trajectories})
    fresh_groups, report = _drop_stale(groups, version, staleness_bound)
    filtered = filter_groups(fresh_groups, weights, advantage)
    rejected = {gid: "equal_rewards" for gid in filtered.dropped_equal_rewards}
    for g in fresh_groups:
        if g.group_id in filtered.dropped_too_small:
            rejected[g.group_id] = "stale" if not g.trajectories else "too_few_samples"
    report["groups/dropped_equal_rewards"] = len(filtered.dropped_equal_rewards)
    report["groups/dropped_too_small"] = len(filtered.dropped_too_small)
    report["samples/failed"] = filtered.num_failed_samples
    if advantage.estimator == "gae":
        samples = [Sample(g.group_id, t.sample_index, t, None, rewards_T=token_rewards(t, weights))
                   for g in filtered.groups for t in g.trajectories]
    else:
        advs = compute_advantages(filtered.groups, weights, advantage)
        samples = [Sample(g.group_id, t.sample_index, t, a)
                   for g, ga in zip(filtered.groups, advs, strict=True) for t, a in zip(g.trajectories, ga, strict=True)]
    return Batch(samples, [g.group_id for g in filtered.groups], rejected, report)


def _drop_stale(groups: list[TrajectoryGroup], version: int, bound: int | None) -> tuple[list[TrajectoryGroup], dict]:
    staleness_all = np.concatenate([staleness_of(t, version) for g in groups for t in g.trajectories] or [np.zeros(0)])
    report: dict[str, Any] = {}
    fresh, num_stale = [], 0
    for g in groups:
        keep = [t for t in g.trajectories
                if bound is None or not t.is_action.any() or int(staleness_of(t, version).max()) <= bound]
        num_stale += len(g.trajectories) - len(keep)
        fresh.append(TrajectoryGroup(g.group_id, g.task_id, keep))
    report["staleness/rejected_samples"] = num_stale
    if staleness_all.size:
        report["staleness/mean"] = float(staleness_all.mean())
        report["staleness/max"] = int(staleness_all.max())
        report["staleness/hist"] = {str(k): int(v) for k, v in sorted(Counter(staleness_all.tolist()).items())}
    return fresh, report
