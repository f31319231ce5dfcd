"""Reward weighting: the one place where the raw reward terms of a trajectory become numbers to train on.

The engine records every term raw and separately (per turn a dict of process terms,
`Turn.process_rewards`; per episode one `task_reward`); nothing is weighted at rollout time, so a run
can be re-weighted or plotted term by term afterwards. The learner weights them here, at training
time, with `RewardWeights` from the `RewardSchedule` (early in training process rewards carry more
weight, later the task reward does, e.g. 0.7/0.3 -> 0.3/0.7 over N optimizer steps).

Shape legend: T = tokens of one trajectory.

Everything below derives from `turn_rewards`: a trajectory's return is their sum, its token-level
rewards put each at its turn's last action token, and the per-step reward metrics report them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from agentrl.common.config import config_dataclass
from agentrl.common.trajectory import Trajectory, TrajectoryGroup


@dataclass(frozen=True)
class RewardWeights:
    """Weights of the raw reward terms at one training step (from the reward schedule)."""

    process: float = 1.0
    """Multiplies every process reward term of every turn (dimensionless)."""
    task: float = 1.0
    """Multiplies the final task reward (dimensionless)."""


@config_dataclass
class RewardSchedule:
    """Linear shift of weight from process to task reward over training steps: (process_start,
    task_start) at step 0 to (process_end, task_end) at `num_steps`, then constant."""

    process_start: float = 0.7
    """Process-term weight at step 0."""
    task_start: float = 0.3
    """Task-reward weight at step 0."""
    process_end: float = 0.3
    """Process-term weight from `num_steps` on."""
    task_end: float = 0.7
    """Task-reward weight from `num_steps` on."""
    num_steps: int = 200
    """Optimizer steps over which the weights move (>= 0; 0 = the end weights from the start)."""

    def __post_init__(self) -> None:
        if self.num_steps < 0:
            raise ValueError(f"reward_schedule.num_steps must be >= 0, got {self.num_steps}")

    def weights(self, step: int) -> RewardWeights:
        """The weights at optimizer step `step`."""
        frac = 1.0 if self.num_steps == 0 else min(max(step / self.num_steps, 0.0), 1.0)
        return RewardWeights(self.process_start + frac * (self.process_end - self.process_start),
                             self.task_start + frac * (self.task_end - self.task_start))


def turn_rewards(traj: Trajectory, weights: RewardWeights) -> list[float]:
    """Weighted reward of each turn: process weight x the sum of its process terms, plus task
    weight x task reward on the last turn."""
    out = [weights.process * float(sum(t.process_rewards.values())) for t in traj.turns]
    if out:
        out[-1] += weights.task * float(traj.task_reward)
    return out


def trajectory_return(traj: Trajectory, weights: RewardWeights) -> float:
    """The sum of `turn_rewards`; for a trajectory without turns, the weighted task reward alone."""
    return float(sum(turn_rewards(traj, weights))) if traj.turns else weights.task * float(traj.task_reward)


def token_rewards(traj: Trajectory, weights: RewardWeights) -> np.ndarray:
    """[T] float32: each turn's weighted reward at its last action token (a turn without action
    tokens uses the last action token before it, or the first one), zero elsewhere. Sums to
    `trajectory_return` when the trajectory has an action token."""
    rewards_T = np.zeros(traj.num_tokens, dtype=np.float32)
    action_idx = np.flatnonzero(traj.is_action)
    if action_idx.size == 0:
        return rewards_T
    for turn, reward in zip(traj.turns, turn_rewards(traj, weights), strict=True):
        if reward == 0.0:
            continue
        before = action_idx[action_idx < turn.action_end]
        rewards_T[before[-1] if before.size else action_idx[0]] += reward
    return rewards_T


def reward_metrics(groups: list[TrajectoryGroup], weights: RewardWeights) -> dict[str, float]:
    """Per-step means over the non-failed trajectories: each raw process term, the task reward,
    the weighted total, the weights, and every episode metric the engine recorded."""
    trajs = [t for g in groups for t in g.trajectories if t.status != "failed"]
    if not trajs:
        return {}
    terms: Counter[str] = Counter()
    for t in trajs:
        for turn in t.turns:
            terms.update(turn.process_rewards)
    out = {f"reward/{k}": v / len(trajs) for k, v in terms.items()}
    out["reward/task"] = float(np.mean([t.task_reward for t in trajs]))
    out["reward/total"] = float(np.mean([trajectory_return(t, weights) for t in trajs]))
    out["reward/weight_process"], out["reward/weight_task"] = weights.process, weights.task
    for key in sorted({k for t in trajs for k in t.metrics}):
        out[f"episode/{key}"] = float(np.mean([t.metrics[key] for t in trajs if key in t.metrics]))
    return out
