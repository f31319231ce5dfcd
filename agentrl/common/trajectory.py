"""The trajectory: the record of one episode that the orchestrator sends to the learner.

This is the contract between `agentrl.engine` (producer) and `agentrl.learner` (consumer).

Shape legend: T = number of tokens in the episode (prompt + all actions + all observations).

Invariants (checked by `Trajectory.validate`):
- `token_ids` is the whole interaction in order, exactly as the policy saw it: it was built by
  appending ids (prompt ids, sampled ids, observation ids); it is never re-tokenized from text.
- `is_action[t] == 1` exactly for tokens the policy sampled; losses and advantages only ever touch
  these. `behavior_logprobs[t]` and `policy_versions[t]` are meaningful only where `is_action`;
  elsewhere they are 0.0 and -1.
- Turns are in order and do not overlap: `turns[i].action_start < turns[i].action_end <=
  turns[i].obs_end <= turns[i+1].action_start`. Every action token lies in exactly one turn.
- Reward terms are recorded raw and separately (`turns[i].process_rewards`, `task_reward`);
  weighting them (the reward schedule) is the learner's decision, made at training time.

A `TrajectoryGroup` holds the n samples of one prompt (GRPO's group). The orchestrator emits a group
once all its samples have finished (or failed: a failed sample is kept, with `status="failed"`, so
that nothing is dropped silently; the learner decides what to do with it).

Wire format (`encode_group` / `decode_group`): frame 0 is a msgpack header with all scalar fields
and, per trajectory, the dtype/length of its arrays; frames 1.. are the raw little-endian array
buffers (4 per trajectory, in the order of `ARRAY_FIELDS`), so arrays cross the socket without a
per-element encode.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

import msgpack
import numpy as np

WIRE_VERSION = 1

ARRAY_FIELDS: tuple[tuple[str, np.dtype], ...] = (
    ("token_ids", np.dtype("<i4")),
    ("is_action", np.dtype("u1")),
    ("behavior_logprobs", np.dtype("<f4")),
    ("policy_versions", np.dtype("<i4")),
)

Status = Literal["ok", "truncated", "failed"]


@dataclass
class Turn:
    """One model action and the observation that answered it."""

    action_start: int
    """Index in `token_ids` of the first token the policy sampled in this turn."""
    action_end: int
    """Exclusive end of the action tokens."""
    obs_end: int
    """Exclusive end of the observation (template boundary + tool results) that followed;
    equals `action_end` for the final turn when nothing followed."""
    process_rewards: dict[str, float] = field(default_factory=dict)
    """Process reward terms earned by this turn, by name (e.g. "valid_call": 0.1,
    "malformed_call": -0.2). Raw values; the learner applies the reward schedule."""
    num_tool_calls: int = 0
    """Tool calls parsed from this action (valid or not)."""


@dataclass
class Trajectory:
    task_id: str
    group_id: str
    sample_index: int
    """Index of this sample within its group, 0..n-1."""
    token_ids: np.ndarray
    """[T] int32: the whole episode as token ids."""
    is_action: np.ndarray
    """[T] uint8: 1 where the policy sampled the token, else 0."""
    behavior_logprobs: np.ndarray
    """[T] float32: log-prob of the sampled token under the policy that sampled it (from vLLM);
    0.0 where not an action."""
    policy_versions: np.ndarray
    """[T] int32: policy version (learner step that produced the weights) that sampled each token;
    -1 where not an action."""
    prompt_len: int
    """Number of tokens of the initial state (system prompt + tool specs + task)."""
    turns: list[Turn]
    task_reward: float
    """Final task reward (e.g. exact match in {0, 1}, or F1), before any weighting."""
    status: Status = "ok"
    """"ok": the episode ended by the policy's answer; "truncated": a limit (turns, tokens)
    ended it; "failed": an infrastructure failure ended it (error says why)."""
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-episode scalars for plots: em, f1, num_turns, num_tool_calls, ..."""
    timing: dict[str, float] = field(default_factory=dict)
    """Seconds: "generate_s", "tool_s", "wall_s", and the unix "start_time"/"end_time"."""

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def validate(self) -> None:
        """Raise ValueError if the invariants in the module docstring do not hold."""
        num_tokens = self.num_tokens
        for name, dtype in ARRAY_FIELDS:
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.shape[0] != num_tokens:
                raise ValueError(f"trajectory {self.group_id}/{self.sample_index}: {name} must be a 1-D array of length {num_tokens}")
            if arr.dtype != dtype:
                raise ValueError(f"trajectory {self.group_id}/{self.sample_index}: {name} has dtype {arr.dtype}, expected {dtype}")
        if not 0 <= self.prompt_len <= num_tokens:
            raise ValueError(f"prompt_len {self.prompt_len} outside [0, {num_tokens}]")
        if self.is_action[: self.prompt_len].any():
            raise ValueError("prompt tokens are marked as actions")
        covered = np.zeros(num_tokens, dtype=bool)
        prev_end = self.prompt_len
        for i, turn in enumerate(self.turns):
            if not prev_end <= turn.action_start <= turn.action_end <= turn.obs_end <= num_tokens:
                raise ValueError(f"turn {i} boundaries out of order: {turn}")
            covered[turn.action_start : turn.action_end] = True
            prev_end = turn.obs_end
        if not np.array_equal(covered, self.is_action.astype(bool)):
            raise ValueError("action tokens and turn action spans disagree")
        off = ~covered
        if (self.policy_versions[off] != -1).any() or (self.behavior_logprobs[off] != 0).any():
            raise ValueError("non-action tokens carry a behavior log-prob or policy version")


@dataclass
class TrajectoryGroup:
    """The n samples of one prompt; the unit the orchestrator streams and the learner acknowledges."""

    group_id: str
    """Unique across a run (also across orchestrator restarts); the learner deduplicates by it."""
    task_id: str
    trajectories: list[Trajectory]

    @property
    def min_policy_version(self) -> int:
        versions = [int(t.policy_versions[t.is_action.astype(bool)].min()) for t in self.trajectories if t.is_action.any()]
        return min(versions) if versions else -1


def encode_group(group: TrajectoryGroup) -> list[bytes]:
    """Frames for one group: [msgpack header, then 4 raw array buffers per trajectory]."""
    header_trajs = []
    buffers: list[bytes] = []
    for traj in group.trajectories:
        fields = {k: v for k, v in asdict(traj).items() if k not in dict(ARRAY_FIELDS)}
        fields["turns"] = [asdict(t) for t in traj.turns]
        header_trajs.append(fields)
        for name, dtype in ARRAY_FIELDS:
            buffers.append(np.ascontiguousarray(getattr(traj, name), dtype=dtype).tobytes())
    header = {
        "wire_version": WIRE_VERSION,
        "group_id": group.group_id,
        "task_id": group.task_id,
        "trajectories": header_trajs,
    }
    return [msgpack.packb(header, use_bin_type=True), *buffers]


def decode_group(frames: list[bytes]) -> TrajectoryGroup:
    """Inverse of `encode_group`. Raises ValueError on a malformed or foreign message."""
    if not frames:
        raise ValueError("empty trajectory group message")
    header = msgpack.unpackb(frames[0], raw=False)
    if not isinstance(header, dict) or header.get("wire_version") != WIRE_VERSION:
        raise ValueError(f"unsupported trajectory wire version: {header.get('wire_version') if isinstance(header, dict) else header!r}")
    trajs_h = header["trajectories"]
    expected = 1 + len(ARRAY_FIELDS) * len(trajs_h)
    if len(frames) != expected:
        raise ValueError(f"trajectory group {header['group_id']}: {len(frames)} frames, expected {expected}")
    trajectories = []
    pos = 1
    for fields in trajs_h:
        arrays = {}
        for name, dtype in ARRAY_FIELDS:
            arrays[name] = np.frombuffer(frames[pos], dtype=dtype).copy()
            pos += 1
        fields = dict(fields)
        fields["turns"] = [Turn(**t) for t in fields["turns"]]
        traj = Trajectory(**fields, **arrays)
        traj.validate()
        trajectories.append(traj)
    return TrajectoryGroup(group_id=header["group_id"], task_id=header["task_id"], trajectories=trajectories)
