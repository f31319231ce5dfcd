"""Episode records: what a run keeps of each episode it played, for reading it later.

One JSON object per episode. Evaluations write theirs to RUN_DIR/evals/LABEL-vVERSION.text.jsonl.gz
(gzip); the actor appends each group it sends to the learner to RUN_DIR/actor/episodes.jsonl (plain
text, one group per line, so that a run still being written reads up to its last whole line).
`agentrl view` shows them and `agentrl rescore` scores them again; both read the run directory only
(a run copied from another host opens the same), which is why a record carries the task and the
decoded text as well as the token ids.

An episode record:
    task_id, group_id, sample_index, status, error, task_reward, metrics
    task        the task played: {task_id, prompt, messages, reference, metadata}
    prompt_len  tokens of the initial state
    token_ids   every token of the episode
    turns       [{action_start, action_end, obs_end, process_rewards, num_tool_calls}]
    segments    the episode in order: {"kind": "prompt" | "action" | "observation", "text": ...};
                an action segment also has "pieces" (each sampled token's text), "logprobs" and
                "versions" (the policy version that sampled each), one per action token
    messages    [[role, content, tail]] (engine/chat.py renders them to the token ids' text)
    calls       the tool calls as `reward` saw them: {turn, name, arguments, success, content, error, repeated}
    answer      the final answer the environment parsed (null without one)
    text        the whole episode decoded

A group line of RL episodes: {"group_id", "task_id", "time", "episodes": [record, ...]}.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from agentrl.common.trajectory import Trajectory, Turn

EPISODES_FILE = "episodes.jsonl"
"""The actor's group records, in the actor's folder (RUN_DIR/actor)."""


def _jsonable(value: Any) -> Any:
    """`value` as JSON can hold it: dataclasses as dicts, tuples as lists, anything else as its str."""
    return json.loads(json.dumps(value, default=lambda v: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else str(v)))


def episode_record(traj: Trajectory, chat) -> dict:
    """The record of one played episode (`chat`: engine.chat.ChatFormat, its tokenizer decodes)."""
    ids = traj.token_ids.tolist()
    segments: list[dict] = [{"kind": "prompt", "text": chat.decode(ids[: traj.prompt_len])}]
    pos = traj.prompt_len
    for turn in traj.turns:
        if turn.action_start > pos:  # template tokens between an observation and the action
            segments.append({"kind": "observation", "text": chat.decode(ids[pos: turn.action_start])})
        action = ids[turn.action_start: turn.action_end]
        segments.append({"kind": "action", "text": chat.decode(action), "pieces": [chat.decode([i]) for i in action],
                         "logprobs": [round(float(x), 5) for x in traj.behavior_logprobs[turn.action_start: turn.action_end]],
                         "versions": traj.policy_versions[turn.action_start: turn.action_end].tolist()})
        if turn.obs_end > turn.action_end:
            segments.append({"kind": "observation", "text": chat.decode(ids[turn.action_end: turn.obs_end])})
        pos = turn.obs_end
    if pos < len(ids):
        segments.append({"kind": "observation", "text": chat.decode(ids[pos:])})
    return {
        "task_id": traj.task_id, "group_id": traj.group_id, "sample_index": traj.sample_index, "status": traj.status,
        "error": traj.error, "task_reward": traj.task_reward,
        "metrics": {k: v for k, v in traj.metrics.items() if math.isfinite(v)},
        "task": _jsonable(traj.task) if traj.task is not None else None,
        "prompt_len": traj.prompt_len, "token_ids": ids,
        "turns": [dataclasses.asdict(t) for t in traj.turns],
        "segments": segments,
        "messages": _jsonable(traj.messages), "calls": _jsonable(traj.calls), "answer": _jsonable(traj.answer),
        "text": chat.decode(ids),
    }


def write_episode_records(path: Path, trajectories: Iterable[Trajectory], chat) -> None:
    """Evaluation episodes, ordered by task id, gzip-compressed (~10x smaller)."""
    with gzip.open(path, "wt") as f:
        for traj in sorted(trajectories, key=lambda t: t.task_id):
            f.write(json.dumps(episode_record(traj, chat)) + "\n")


def append_group_record(path: Path, group, chat) -> None:
    """One line for a group of RL episodes, appended (and flushed) whole."""
    import time

    line = json.dumps({"group_id": group.group_id, "task_id": group.task_id, "time": time.time(),
                       "episodes": [episode_record(t, chat) for t in group.trajectories]})
    with open(path, "a") as f:
        f.write(line + "\n")


def read_json_lines(path: Path) -> tuple[list[dict], int]:
    """The JSON objects of a .jsonl or .jsonl.gz file and how many lines were skipped: a last line
    still being written (no newline yet), or a line that does not parse (a copy cut short). A
    gzip file still being written reads up to where its stream ends."""
    opener = gzip.open if path.name.endswith(".gz") else open
    records: list[dict] = []
    skipped = 0
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.endswith("\n"):  # the last line, still being written
                    skipped += 1
                    continue
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    skipped += 1
                    continue
                if isinstance(obj, dict):
                    records.append(obj)
                else:
                    skipped += 1
    except EOFError:  # a gzip stream not yet closed: what was read stands
        skipped += 1
    return records, skipped


def trajectory_of(record: dict) -> Trajectory:
    """The trajectory a record was made from (the arrays the learner used, rebuilt; ValueError when
    the record does not hold together)."""
    ids = np.asarray(record["token_ids"], dtype=np.int32)
    is_action = np.zeros(len(ids), dtype=np.uint8)
    logprobs = np.zeros(len(ids), dtype=np.float32)
    versions = np.full(len(ids), -1, dtype=np.int32)
    turns = [Turn(**t) for t in record["turns"]]
    actions = [s for s in record["segments"] if s["kind"] == "action"]
    if len(actions) != len(turns):
        raise ValueError(f"{len(actions)} action segments for {len(turns)} turns")
    for turn, segment in zip(turns, actions, strict=True):
        is_action[turn.action_start: turn.action_end] = 1
        logprobs[turn.action_start: turn.action_end] = segment["logprobs"]
        versions[turn.action_start: turn.action_end] = segment["versions"]
    traj = Trajectory(task_id=record["task_id"], group_id=record["group_id"], sample_index=record["sample_index"],
                      token_ids=ids, is_action=is_action, behavior_logprobs=logprobs, policy_versions=versions,
                      prompt_len=record["prompt_len"], turns=turns, task_reward=float(record["task_reward"]),
                      status=record["status"], error=record.get("error"), metrics=dict(record.get("metrics", {})))
    traj.validate()
    return traj
