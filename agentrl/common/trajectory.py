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

What a receiver accepts (`decode_group`, which raises `GroupRejected` naming the field): the header
decodes into the typed structs below (a str group id, float rewards, int boundaries: msgpack's own
types, no coercion beyond int -> float); the frame count and every array's byte length fit the
header; every float on the wire (rewards, log-probs, metrics, timings) is finite; `is_action` is 0
or 1; token ids lie in [0, vocab_size) when the receiver knows its model's vocabulary; policy
versions are -1 (no policy: prompt, observation, gold SFT action) or >= 0; and `Trajectory.validate`
holds. The learner checks this before it spools and acknowledges a group, so a group that would
fail later (a NaN reward makes NaN advantages; an id past the vocabulary fails the embedding
lookup) is refused once, with a reason, instead of being replayed into every restart.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any, Literal

import msgpack
import msgspec
import numpy as np

WIRE_VERSION = 1

ARRAY_FIELDS: tuple[tuple[str, np.dtype], ...] = (
    ("token_ids", np.dtype("<i4")),
    ("is_action", np.dtype("u1")),
    ("behavior_logprobs", np.dtype("<f4")),
    ("policy_versions", np.dtype("<i4")),
)

Status = Literal["ok", "truncated", "failed"]
LOCAL_FIELDS = frozenset({"task", "messages", "calls", "answer"})
"""Trajectory fields kept where the episode was played and not sent to the learner."""

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


class GroupRejected(ValueError):
    """A trajectory group message that the learner must not train on; says which group (when the
    header names one) and why."""

    def __init__(self, reason: str, group_id: str | None = None):
        super().__init__(f"trajectory group {group_id!r}: {reason}" if group_id is not None else reason)
        self.reason = reason
        self.group_id = group_id


def int32_array(values, field: str) -> np.ndarray:
    """`values` as an int32 array, or a ValueError naming `field` and the first value outside int32
    (numpy's own cast either wraps silently or raises an OverflowError that names nothing)."""
    arr = np.asarray(values)
    if arr.size and arr.dtype.kind not in "iub":
        raise ValueError(f"{field}: expected integers, got dtype {arr.dtype}")
    if arr.size and arr.dtype.kind != "b" and arr.dtype.itemsize >= 4 and (arr.min() < INT32_MIN or arr.max() > INT32_MAX):
        bad = arr[(arr < INT32_MIN) | (arr > INT32_MAX)][0]
        raise ValueError(f"{field}: value {int(bad)} is outside the int32 range [{INT32_MIN}, {INT32_MAX}]")
    return np.ascontiguousarray(arr, dtype=np.int32)


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
    # Kept where the episode was played, for the run's episode records (agentrl/common/records.py:
    # `agentrl view`, `agentrl rescore`); never on the wire to the learner (LOCAL_FIELDS).
    task: Any = None
    """The engine.task.Task played, or None."""
    messages: list = field(default_factory=list)
    """(role, content, tail) per message, what `token_ids` decodes to (engine.env.EpisodeState.messages)."""
    calls: list = field(default_factory=list)
    """The tool calls as the environment's `reward` saw them (engine.env.CallRecord), in order."""
    answer: Any = None
    """The final answer the environment parsed; None when the episode ended without one."""

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
    """Frames for one group: [msgpack header, then 4 raw array buffers per trajectory]. Raises
    ValueError naming the field when an integer array does not fit the wire's int32."""
    header_trajs = []
    buffers: list[bytes] = []
    for traj in group.trajectories:
        fields = {f.name: getattr(traj, f.name) for f in dataclass_fields(traj)
                  if f.name not in dict(ARRAY_FIELDS) and f.name not in LOCAL_FIELDS}
        fields["turns"] = [asdict(t) for t in traj.turns]
        header_trajs.append(fields)
        for name, dtype in ARRAY_FIELDS:
            arr = getattr(traj, name)
            if dtype == np.dtype("<i4"):
                arr = int32_array(arr, f"trajectory {group.group_id}/{traj.sample_index}: {name}")
            buffers.append(np.ascontiguousarray(arr, dtype=dtype).tobytes())
    header = {
        "wire_version": WIRE_VERSION,
        "group_id": group.group_id,
        "task_id": group.task_id,
        "trajectories": header_trajs,
    }
    return [msgpack.packb(header, use_bin_type=True), *buffers]


# The header as the receiver types it (msgspec: int is accepted for float, nothing else is coerced).
class _TurnWire(msgspec.Struct, forbid_unknown_fields=True):
    action_start: int
    action_end: int
    obs_end: int
    process_rewards: dict[str, float] = {}
    num_tool_calls: int = 0


class _TrajectoryWire(msgspec.Struct, forbid_unknown_fields=True):
    task_id: str
    group_id: str
    sample_index: int
    prompt_len: int
    turns: list[_TurnWire]
    task_reward: float
    status: Status = "ok"
    error: str | None = None
    metrics: dict[str, float] = {}
    timing: dict[str, float] = {}


class _GroupWire(msgspec.Struct, forbid_unknown_fields=True):
    wire_version: int
    group_id: str
    task_id: str
    trajectories: list[_TrajectoryWire]


_HEADER = msgspec.msgpack.Decoder(_GroupWire)


def header_group_id(frame: bytes) -> str | None:
    """The group id a header frame names, if it decodes to a map with a str `group_id` (for
    answering a sender about a message that is otherwise unreadable)."""
    try:
        header = msgspec.msgpack.decode(frame)
    except msgspec.MsgspecError:
        return None
    group_id = header.get("group_id") if isinstance(header, dict) else None
    return group_id if isinstance(group_id, str) else None


def decode_group(frames: list[bytes], *, vocab_size: int | None = None) -> TrajectoryGroup:
    """Inverse of `encode_group`, with the checks of the module docstring (`vocab_size`: the
    model's number of token ids; None skips the upper bound). Raises `GroupRejected`."""
    if not frames:
        raise GroupRejected("empty trajectory group message")
    try:
        header = _HEADER.decode(frames[0])
    except msgspec.MsgspecError as err:
        raise GroupRejected(f"header: {err}", header_group_id(frames[0])) from None
    gid = header.group_id
    if header.wire_version != WIRE_VERSION:
        raise GroupRejected(f"unsupported wire version {header.wire_version} (this side speaks {WIRE_VERSION})", gid)
    expected = 1 + len(ARRAY_FIELDS) * len(header.trajectories)
    if len(frames) != expected:
        raise GroupRejected(f"{len(frames)} frames, expected {expected} (1 header + 4 per trajectory)", gid)
    trajectories = []
    pos = 1
    for fields in header.trajectories:
        where = f"trajectory {fields.sample_index}"
        arrays = {}
        for name, dtype in ARRAY_FIELDS:
            if len(frames[pos]) % dtype.itemsize:
                raise GroupRejected(f"{where}: {name} frame of {len(frames[pos])} bytes is not a whole number of "
                                    f"{dtype} values", gid)
            arrays[name] = np.frombuffer(frames[pos], dtype=dtype).copy()
            pos += 1
        turns = [Turn(t.action_start, t.action_end, t.obs_end, dict(t.process_rewards), t.num_tool_calls)
                 for t in fields.turns]
        traj = Trajectory(task_id=fields.task_id, group_id=fields.group_id, sample_index=fields.sample_index,
                          prompt_len=fields.prompt_len, turns=turns, task_reward=fields.task_reward,
                          status=fields.status, error=fields.error, metrics=dict(fields.metrics),
                          timing=dict(fields.timing), **arrays)
        try:
            traj.validate()
            check_trajectory(traj, vocab_size)
        except ValueError as err:
            raise GroupRejected(f"{where}: {err}", gid) from None
        trajectories.append(traj)
    return TrajectoryGroup(group_id=gid, task_id=header.task_id, trajectories=trajectories)


def check_trajectory(traj: Trajectory, vocab_size: int | None) -> None:
    """The receiver's checks beyond `Trajectory.validate` (module docstring); ValueError naming the field."""
    for name, value in [("task_reward", traj.task_reward),
                        *((f"turns[{i}].process_rewards[{k!r}]", v) for i, t in enumerate(traj.turns)
                          for k, v in t.process_rewards.items()),
                        *((f"metrics[{k!r}]", v) for k, v in traj.metrics.items()),
                        *((f"timing[{k!r}]", v) for k, v in traj.timing.items())]:
        if not math.isfinite(value):
            raise ValueError(f"{name} is {value}, not a finite number")
    if not np.isfinite(traj.behavior_logprobs).all():
        bad = int(np.flatnonzero(~np.isfinite(traj.behavior_logprobs))[0])
        raise ValueError(f"behavior_logprobs[{bad}] is {traj.behavior_logprobs[bad]}, not a finite number")
    if traj.is_action.size and traj.is_action.max() > 1:
        raise ValueError(f"is_action holds {int(traj.is_action.max())}; only 0 and 1 are allowed")
    if traj.token_ids.size:
        low, high = int(traj.token_ids.min()), int(traj.token_ids.max())
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            bad = low if low < 0 else high
            raise ValueError(f"token_ids holds {bad}, outside the model's vocabulary [0, {vocab_size if vocab_size is not None else 'V'})")
    if traj.policy_versions.size and int(traj.policy_versions.min()) < -1:
        raise ValueError(f"policy_versions holds {int(traj.policy_versions.min())}; versions are -1 (no policy) or >= 0")


def single_group(group_id: str, traj: Trajectory) -> TrajectoryGroup:
    """A group of one trajectory (an SFT or anchor demonstration) under `group_id`."""
    from dataclasses import replace

    return TrajectoryGroup(group_id, traj.task_id, [replace(traj, group_id=group_id)])
