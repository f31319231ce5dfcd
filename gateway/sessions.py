"""Sessions: the exact token record of one agent episode, split into segments.

A session is named by the client (`X-Agentrl-Session: ID` or a `/s/ID/v1` base URL) and opened by
its first request. For every turn it records the prompt ids the gateway sent and the ids the model
sampled, with each sampled token's log-prob and policy version.

Segments. A turn joins a segment when its prompt extends that segment's tokens (every earlier
prompt and completion) token for token; the new prompt tokens (tool results, the next user
message, the turn boundaries) are then observation tokens of the segment. A prompt that extends no
open segment (the agent edited, truncated or summarised its history, or branched) opens a new
segment, counted in `num_prefix_breaks`; it is trained as its own sample. The 16 most recent
segments are tried, newest first, so an agent that interleaves a side conversation (a summariser
call) with its main thread keeps the main thread in one segment.

Exactness. The ids of a segment are never re-tokenized: prompt ids are the renderer's, and the
gateway's own earlier completions re-enter the prompt as their recorded ids (see `render`), keyed
by what the gateway answered (content + tool call ids, names and arguments; the arguments also
compared as parsed JSON, for clients that re-serialise them). `is_action` is 1 exactly on sampled
ids; the forced-call prefill of `tool_choice` is a prompt token.

Lifecycle and memory. A session lives until `DELETE /agentrl/sessions/{id}` (which answers its
final record) or until it has been idle for `idle_s` with no request in flight (swept by the
gateway; counted in `num_expired`, and handed to the same `on_end` hook as a closed one, so no
finished session disappears unseen). At most `max_sessions` are open; a request that would open one
more is refused (429) rather than growing memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np

from agentrl.common.trajectory import Trajectory, Turn, int32_array
from agentrl.gateway.protocol import GatewayError, Message, text_of
from agentrl.gateway.render import Recorded, Rendered

log = logging.getLogger(__name__)

MAX_SEGMENTS_TRIED = 16


@dataclass
class TurnRecord:
    action_start: int
    action_end: int
    obs_end: int
    num_tool_calls: int
    finish_reason: str


@dataclass
class Segment:
    """One trainable sample: parallel per-token lists, as the learner's Trajectory holds them."""

    token_ids: list[int]
    is_action: list[int]
    logprobs: list[float | None]
    """Behaviour log-prob of each sampled token; None on prompt and observation tokens."""
    versions: list[int | None]
    """Policy version that sampled each token; None on prompt and observation tokens."""
    prompt_len: int
    turns: list[TurnRecord] = field(default_factory=list)

    @classmethod
    def starting_with(cls, prompt_ids: list[int]) -> Segment:
        n = len(prompt_ids)
        return cls(list(prompt_ids), [0] * n, [None] * n, [None] * n, n)

    def extends(self, prompt_ids: list[int]) -> bool:
        n = len(self.token_ids)
        return len(prompt_ids) >= n and prompt_ids[:n] == self.token_ids

    def observe(self, ids: list[int]) -> None:
        n = len(ids)
        self.token_ids += ids
        self.is_action += [0] * n
        self.logprobs += [None] * n
        self.versions += [None] * n

    def act(self, ids: list[int], logprobs: list[float], versions: list[int], num_tool_calls: int, finish_reason: str) -> None:
        start = len(self.token_ids)
        self.token_ids += ids
        self.is_action += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += versions
        self.turns.append(TurnRecord(start, len(self.token_ids), len(self.token_ids), num_tool_calls, finish_reason))

    def to_record(self) -> dict:
        return {"prompt_len": self.prompt_len, "token_ids": self.token_ids, "is_action": self.is_action,
                "logprobs": self.logprobs, "versions": self.versions,
                "turns": [{"action_start": t.action_start, "action_end": t.action_end, "obs_end": t.obs_end,
                           "num_tool_calls": t.num_tool_calls, "finish_reason": t.finish_reason} for t in self.turns]}


def _canonical(arguments: str) -> bytes | None:
    """Arguments JSON with sorted keys and no spaces (msgspec: ~2 us; json.loads + dumps took ~11)."""
    try:
        return msgspec.json.encode(msgspec.json.decode(arguments), order="sorted")
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def message_key(content: str, calls: tuple[tuple[str, str, str], ...]) -> tuple:
    """What identifies an assistant message: its content and its calls (id, name, arguments text)."""
    return (content, calls)


def canonical_key(content: str, calls: tuple[tuple[str, str, str], ...]) -> tuple | None:
    if not calls:
        return None
    canonical = tuple((call_id, name, _canonical(arguments)) for call_id, name, arguments in calls)
    return ("canonical", content, canonical)


def echoed_calls(message: Message) -> tuple[tuple[str, str, str], ...]:
    return tuple((c.id, c.function.name, c.function.arguments) for c in message.tool_calls or ())


@dataclass
class Counters:
    num_turns: int = 0
    num_segments: int = 0
    num_prefix_breaks: int = 0
    """Turns whose prompt extended no open segment (a new segment after the first)."""
    num_render_checks: int = 0
    """Recalled completions rendered again from their text (see GatewayConfig.render_check_every)."""
    num_render_drifts: int = 0
    """Of those, the ones whose text did not give back the sampled ids."""
    num_spliced_messages: int = 0
    """Assistant messages in prompts that were the gateway's own completions (recorded ids used)."""
    num_unrecognised_assistant: int = 0
    """Assistant messages in prompts that were not (rendered from their text)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Session:
    def __init__(self, session_id: str):
        self.id = session_id
        self.created_at = time.time()
        self.last_used_s = time.monotonic()
        self.in_flight = 0
        self.segments: list[Segment] = []
        self.counters = Counters()
        self._recorded: dict[tuple, Recorded] = {}
        self.last_rendered: Rendered | None = None
        """The last prompt rendered for this session (the renderer reuses what the next one repeats)."""

    def recall(self, message: Message) -> Recorded | None:
        content, calls = text_of(message), echoed_calls(message)
        recorded = self._recorded.get(message_key(content, calls))
        if recorded is None and calls:
            key = canonical_key(content, calls)
            recorded = self._recorded.get(key) if key is not None else None
        return recorded

    def remember(self, content: str, calls: tuple[tuple[str, str, str], ...], token_ids: list[int]) -> None:
        recorded = Recorded(token_ids)
        self._recorded[message_key(content, calls)] = recorded
        key = canonical_key(content, calls)
        if key is not None:
            self._recorded[key] = recorded

    def record_turn(self, prompt_ids: list[int], ids: list[int], logprobs: list[float], versions: list[int],
                    num_tool_calls: int, finish_reason: str) -> bool:
        """Append one turn; True when it joined an open segment, False when it opened a new one."""
        segment = next((s for s in reversed(self.segments[-MAX_SEGMENTS_TRIED:]) if s.extends(prompt_ids)), None)
        joined = segment is not None
        if joined:
            segment.observe(prompt_ids[len(segment.token_ids):])
            if segment.turns:
                segment.turns[-1].obs_end = len(segment.token_ids)
        else:
            segment = Segment.starting_with(prompt_ids)
            self.segments.append(segment)
            self.counters.num_segments += 1
            if len(self.segments) > 1:
                self.counters.num_prefix_breaks += 1
        segment.act(ids, logprobs, versions, num_tool_calls, finish_reason)
        c = self.counters
        c.num_turns += 1
        c.prompt_tokens += len(prompt_ids)
        c.completion_tokens += len(ids)
        return joined

    def to_record(self) -> dict:
        return {"id": self.id, "created_at": self.created_at, "in_flight": self.in_flight,
                "segments": [s.to_record() for s in self.segments], "counters": vars(self.counters).copy()}


class SessionStore:
    """Open sessions by id, with the bounds and expiry described in the module docstring."""

    def __init__(self, *, idle_s: float, max_sessions: int, on_end: Callable[[dict, str], None] | None = None):
        self.idle_s = idle_s
        self.max_sessions = max_sessions
        self.on_end = on_end
        """Called with (final record, "closed" | "expired") when a session ends."""
        self._sessions: dict[str, Session] = {}
        self.num_opened = self.num_closed = self.num_expired = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def ids(self) -> list[str]:
        return list(self._sessions)

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise GatewayError(404, f"no open session {session_id!r} (never opened, closed, or expired after {self.idle_s:.0f} s idle)",
                               param="session_id", code="session_not_found")
        return session

    def open(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            if len(self._sessions) >= self.max_sessions:
                raise GatewayError(429, f"{len(self._sessions)} sessions are open, the gateway's limit (max_sessions); "
                                   "close finished ones with DELETE /agentrl/sessions/{id}", code="too_many_sessions")
            session = self._sessions[session_id] = Session(session_id)
            self.num_opened += 1
        session.last_used_s = time.monotonic()
        return session

    def close(self, session_id: str) -> dict:
        session = self.get(session_id)
        del self._sessions[session_id]
        self.num_closed += 1
        return self._ended(session, "closed")

    def expire(self, now_s: float | None = None) -> int:
        now_s = time.monotonic() if now_s is None else now_s
        idle = [s for s in self._sessions.values() if s.in_flight == 0 and now_s - s.last_used_s > self.idle_s]
        for session in idle:
            del self._sessions[session.id]
            self.num_expired += 1
            self._ended(session, "expired")
        if idle:
            log.info("expired %d idle sessions (idle > %.0f s)", len(idle), self.idle_s)
        return len(idle)

    def _ended(self, session: Session, how: str) -> dict:
        record = session.to_record()
        if self.on_end is not None:
            self.on_end(record, how)
        return record


def session_trajectories(record: dict, *, task_id: str | None = None, group_id: str | None = None,
                         task_reward: float = 0.0) -> list[Trajectory]:
    """One validated Trajectory per segment of a session record (`Session.to_record()` or the JSON of
    `GET /agentrl/sessions/{id}`). `sample_index` is the segment's index; task and group ids default
    to the session id. The gateway knows no reward: `task_reward` is the caller's."""
    trajectories = []
    segments = record["segments"]
    for k, seg in enumerate(segments):
        is_action = np.asarray(seg["is_action"], dtype=np.uint8)
        logprobs = np.asarray([0.0 if x is None else x for x in seg["logprobs"]], dtype=np.float32)
        versions = int32_array([-1 if x is None else x for x in seg["versions"]], "policy_versions")
        turns = [Turn(t["action_start"], t["action_end"], t["obs_end"], num_tool_calls=t["num_tool_calls"]) for t in seg["turns"]]
        truncated = bool(seg["turns"]) and seg["turns"][-1]["finish_reason"] == "length"
        traj = Trajectory(
            task_id=task_id or record["id"], group_id=group_id or record["id"], sample_index=k,
            token_ids=int32_array(seg["token_ids"], "token_ids"), is_action=is_action,
            behavior_logprobs=logprobs, policy_versions=versions, prompt_len=seg["prompt_len"], turns=turns,
            task_reward=float(task_reward), status="truncated" if truncated else "ok",
            metrics={"num_turns": float(len(turns)), "num_tool_calls": float(sum(t.num_tool_calls for t in turns)),
                     "segment_index": float(k), "num_segments": float(len(segments))},
        )
        traj.validate()
        trajectories.append(traj)
    return trajectories
