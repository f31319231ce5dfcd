"""Advantage estimators for the GRPO family, REINFORCE++ and PPO with GAE, over trajectory groups.

Shape legend: T = tokens of one trajectory (prompt + actions + observations), n = samples per group.

Rewards are weighted in one place, `rewards.py` (`trajectory_return`, `token_rewards`); the
estimators below only combine those numbers.

Estimators (all produce token-level advantages that are exactly 0 on non-action tokens, Agent-R1's
advantage mask):
- "grpo": (R_i - mean_group R) / (std_group R + eps) with `std_normalise`, else R_i - mean.
- "dr_grpo": R_i - mean_group R (Dr. GRPO removes the std and the per-length normalisation; pair
  it with `PolicyLossConfig(agg="constant")` in the loss).
- "rloo": R_i - mean_{j != i} R_j (leave-one-out baseline).
These three are outcome estimators: one scalar per trajectory, broadcast over its action tokens
(the formulation of verl and Agent-R1, where process rewards add into the trajectory's score).
- "reinforce_pp": return-to-go over action tokens, G_t = r_t + gamma * G_{t+1} (observation tokens
  are skipped: they are not decisions), whitened over the batch's action tokens. Process rewards
  therefore only credit the actions at or before the turn that earned them.
- "reinforce_pp_baseline": G_t - mean_group(R) before the batch whitening.
- "gae": PPO's generalised advantage estimation with a value per token (from the critic head),
  over action tokens only: the "next state" of the last action token of a turn is the first
  action token of the next turn (the observation between them is the environment's move).

Groups. Trajectories with status "failed" (infrastructure failure) carry no meaningful reward and
are dropped before estimation; a group left with fewer than `min_group_size` samples is dropped
(a group-relative baseline needs 2). Dynamic sampling (DAPO) drops groups whose returns are all
equal: their group-relative advantages are all zero and would only dilute the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from agentrl.common.config import config_dataclass
from agentrl.common.trajectory import TrajectoryGroup
from agentrl.learner.rewards import RewardWeights, token_rewards, trajectory_return

Estimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"]
ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


@config_dataclass
class AdvantageConfig:
    estimator: Estimator = "grpo"
    """Which estimator (module docstring)."""
    std_normalise: bool = True
    """grpo only: divide by the group's reward standard deviation."""
    gamma: float = 1.0
    """Discount per action token for reinforce_pp* and gae (1.0 = undiscounted, the usual choice
    for LLM RL where the reward is sparse)."""
    lam: float = 0.95
    """GAE lambda."""
    eps: float = 1e-6
    """Added to standard deviations before dividing."""
    dynamic_sampling: bool = False
    """Drop groups whose returns are all equal (DAPO's dynamic sampling)."""
    min_group_size: int = 2
    """Groups with fewer usable (non-failed) samples are dropped (group estimators only)."""

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"advantage estimator {self.estimator!r} unknown; choose one of {ESTIMATORS}")
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"gamma={self.gamma} must be in (0, 1]")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam={self.lam} must be in [0, 1]")
        if self.min_group_size < 1:
            raise ValueError(f"min_group_size={self.min_group_size} must be >= 1")


@dataclass
class Filtered:
    """The groups kept for training and why others were not."""

    groups: list[TrajectoryGroup]
    num_failed_samples: int = 0
    dropped_too_small: list[str] = field(default_factory=list)
    """group ids dropped because too few samples were usable."""
    dropped_equal_rewards: list[str] = field(default_factory=list)
    """group ids dropped by dynamic sampling."""


def filter_groups(groups: list[TrajectoryGroup], weights: RewardWeights, config: AdvantageConfig) -> Filtered:
    """Drop failed samples, too-small groups and (with dynamic sampling) equal-reward groups."""
    out = Filtered(groups=[])
    min_size = config.min_group_size if config.estimator in GROUP_ESTIMATORS else 1
    for group in groups:
        usable = [t for t in group.trajectories if t.status != "failed"]
        out.num_failed_samples += len(group.trajectories) - len(usable)
        if len(usable) < min_size:
            out.dropped_too_small.append(group.group_id)
            continue
        returns = [trajectory_return(t, weights) for t in usable]
        if config.dynamic_sampling and max(returns) == min(returns):
            out.dropped_equal_rewards.append(group.group_id)
            continue
        kept = group if len(usable) == len(group.trajectories) else TrajectoryGroup(group.group_id, group.task_id, usable)
        out.groups.append(kept)
    return out


def returns_to_go(rewards_T: np.ndarray, is_action_T: np.ndarray, gamma: float) -> np.ndarray:
    """[T] float32 G_t = r_t + gamma * G_next over action tokens only; 0 on other tokens."""
    out_T = np.zeros_like(rewards_T, dtype=np.float32)
    running = 0.0
    for t in np.flatnonzero(is_action_T)[::-1]:
        running = float(rewards_T[t]) + gamma * running
        out_T[t] = running
    return out_T


def gae(
    rewards_T: np.ndarray, values_T: np.ndarray, is_action_T: np.ndarray, gamma: float, lam: float
) -> tuple[np.ndarray, np.ndarray]:
    """(advantages_T, returns_T) by GAE over action tokens; the value after the last action is 0."""
    adv_T = np.zeros(rewards_T.shape[0], dtype=np.float32)
    next_value = 0.0
    running = 0.0
    for t in np.flatnonzero(is_action_T)[::-1]:
        delta = float(rewards_T[t]) + gamma * next_value - float(values_T[t])
        running = delta + gamma * lam * running
        adv_T[t] = running
        next_value = float(values_T[t])
    returns_T = np.where(is_action_T.astype(bool), adv_T + values_T.astype(np.float32), 0.0).astype(np.float32)
    return adv_T, returns_T



def gae_over_actions(samples, seq_ids_N: np.ndarray, values_N: np.ndarray, gamma: float,
                     lam: float) -> tuple[np.ndarray, np.ndarray]:
    """GAE for the action tokens of packed samples (a micro-batch's `samples`, each with its weighted
    token rewards `rewards_T`): `values_N` are the critic's values at the packed action tokens,
    `seq_ids_N` which sample each belongs to. Returns (advantages_N, returns_N) in the same order."""
    adv_N = np.zeros_like(values_N)
    ret_N = np.zeros_like(values_N)
    for s_idx, sample in enumerate(samples):
        if sample.rewards_T is None:
            raise ValueError(f"sample {sample.group_id}/{sample.sample_index} has no rewards_T; GAE needs them")
        rows = np.flatnonzero(seq_ids_N == s_idx)
        traj = sample.trajectory
        action_T = np.flatnonzero(traj.is_action[1:]) + 1
        values_T = np.zeros(traj.num_tokens, dtype=np.float32)
        values_T[action_T] = values_N[rows]
        adv_T, ret_T = gae(sample.rewards_T, values_T, traj.is_action, gamma, lam)
        adv_N[rows] = adv_T[action_T]
        ret_N[rows] = ret_T[action_T]
    return adv_N, ret_N

def _whiten(advs: list[np.ndarray], masks: list[np.ndarray], eps: float) -> list[np.ndarray]:
    """Whiten over all action tokens of the batch (REINFORCE++'s global normalisation)."""
    values = np.concatenate([a[m] for a, m in zip(advs, masks, strict=True)]) if advs else np.zeros(0)
    if values.size == 0:
        return advs
    mean, std = float(values.mean()), float(values.std())
    return [np.where(m, (a - mean) / (std + eps), 0.0).astype(np.float32) for a, m in zip(advs, masks, strict=True)]


def compute_advantages(
    groups: list[TrajectoryGroup],
    weights: RewardWeights,
    config: AdvantageConfig,
    values: list[list[np.ndarray]] | None = None,
) -> list[list[np.ndarray]]:
    """Token-level advantages `[group][sample] -> [T] float32`, zero on non-action tokens.

    `groups` should already have passed `filter_groups`. `values[group][sample]` ([T], the critic's
    value per token) is required for "gae" and ignored otherwise.
    """
    est = config.estimator
    if est == "gae" and values is None:
        raise ValueError("the 'gae' estimator needs per-token values from the critic (values=...)")
    out: list[list[np.ndarray]] = []
    for gi, group in enumerate(groups):
        trajs = group.trajectories
        masks = [t.is_action.astype(bool) for t in trajs]
        if est in ("grpo", "dr_grpo", "rloo"):
            returns_n = np.array([trajectory_return(t, weights) for t in trajs], dtype=np.float64)
            n = returns_n.shape[0]
            if est == "rloo":
                if n < 2:
                    raise ValueError(f"group {group.group_id}: RLOO needs at least 2 samples, got {n}")
                scalar_n = returns_n - (returns_n.sum() - returns_n) / (n - 1)
            else:
                scalar_n = returns_n - returns_n.mean()
                if est == "grpo" and config.std_normalise:
                    # Population std over a group is 0 for n=1; eps keeps it finite (advantage 0).
                    scalar_n = scalar_n / (returns_n.std(ddof=1 if n > 1 else 0) + config.eps)
            out.append([np.where(m, s, 0.0).astype(np.float32) for m, s in zip(masks, scalar_n, strict=True)])
        elif est in ("reinforce_pp", "reinforce_pp_baseline"):
            advs = [returns_to_go(token_rewards(t, weights), t.is_action, config.gamma) for t in trajs]
            if est == "reinforce_pp_baseline":
                baseline = float(np.mean([trajectory_return(t, weights) for t in trajs]))
                advs = [np.where(m, a - baseline, 0.0).astype(np.float32) for a, m in zip(advs, masks, strict=True)]
            out.append(advs)
        else:
            group_values = values[gi]
            out.append([
                gae(token_rewards(t, weights), v, t.is_action, config.gamma, config.lam)[0]
                for t, v in zip(trajs, group_values, strict=True)
            ])
    if est in ("reinforce_pp", "reinforce_pp_baseline"):
        flat = [a for g in out for a in g]
        flat_masks = [t.is_action.astype(bool) for g in groups for t in g.trajectories]
        whitened = iter(_whiten(flat, flat_masks, config.eps))
        out = [[next(whitened) for _ in g] for g in out]
    return out
