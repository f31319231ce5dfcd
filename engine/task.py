"""The task: what one episode (one GRPO group) is about. Environments interpret it; the engine only carries it.

A task is JSON: an id, what the policy is asked (a `prompt`, the user message, or `messages`, the
whole opening conversation as {"role", "content"} dicts), a `reference` its environment scores
against (gold answers, unit tests, an expected structured answer, ...) and free `metadata`
(difficulty, source, supporting documents, gold actions, ...). The orchestrator, the episode loop,
the trajectory and the learner read only `task_id`; everything else is the environment's.

`Task.from_json(obj, where)` builds one from a loader's row and names the task and the field when
the row is malformed, so a bad task file fails at start with the place to fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class TaskError(ValueError):
    """A malformed task; the message names the task (or its position) and the field."""


@dataclass(frozen=True)
class Task:
    task_id: str
    """Unique within a task set; trajectories and reports refer to the task by it."""
    prompt: str | None = None
    """The user message of the first turn (the environment may wrap it)."""
    messages: tuple[dict[str, str], ...] | None = None
    """Or the opening conversation, {"role", "content"} per message, after the environment's system
    prompt; the last one is the user's."""
    reference: Any = None
    """What the environment scores the episode against (JSON)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Anything else (JSON): difficulty, source, gold actions for demonstrations, ..."""

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Task:
        """A task from a JSON object: {"id" or "task_id", "prompt" or "messages", "reference",
        "metadata"}; TaskError naming `where` (e.g. "tasks.jsonl:12") and the field otherwise."""
        if not isinstance(obj, dict):
            raise TaskError(f"{where}: a task must be a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - {"id", "task_id", "prompt", "messages", "reference", "metadata"})
        if unknown:
            raise TaskError(f"{where}: unknown field(s) {unknown}; a task has id, prompt or messages, reference, metadata")
        task_id = obj.get("task_id", obj.get("id"))
        if not isinstance(task_id, str | int) or isinstance(task_id, bool) or task_id == "":
            raise TaskError(f"{where}: field 'id' (or 'task_id') must be a non-empty string, got {task_id!r}")
        name = f"{where} (task {task_id!r})"
        prompt, messages = obj.get("prompt"), obj.get("messages")
        if (prompt is None) == (messages is None):
            raise TaskError(f"{name}: give exactly one of 'prompt' (a string) or 'messages' (a list)")
        if prompt is not None and not isinstance(prompt, str):
            raise TaskError(f"{name}: field 'prompt' must be a string, got {type(prompt).__name__}")
        if messages is not None:
            messages = tuple(_message(m, f"{name}: messages[{i}]") for i, m in enumerate(_list(messages, f"{name}: messages")))
            if not messages or messages[-1]["role"] != "user":
                raise TaskError(f"{name}: field 'messages' must end with a user message")
        metadata = obj.get("metadata", {})
        if not isinstance(metadata, dict):
            raise TaskError(f"{name}: field 'metadata' must be an object, got {type(metadata).__name__}")
        try:
            json.dumps([obj.get("reference"), metadata])
        except (TypeError, ValueError) as err:
            raise TaskError(f"{name}: 'reference' and 'metadata' must be JSON ({err})") from None
        return cls(str(task_id), prompt, messages, obj.get("reference"), dict(metadata))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.task_id}
        if self.prompt is not None:
            out["prompt"] = self.prompt
        if self.messages is not None:
            out["messages"] = [dict(m) for m in self.messages]
        out["reference"] = self.reference
        out["metadata"] = dict(self.metadata)
        return out


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list | tuple):
        raise TaskError(f"{where} must be a list, got {type(value).__name__}")
    return list(value)


def _message(m: Any, where: str) -> dict[str, str]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
        raise TaskError(f"{where} must be {{\"role\": str, \"content\": str}}, got {m!r}"[:300])
    if m["role"] not in ROLES:
        raise TaskError(f"{where}: role {m['role']!r} is not one of {', '.join(ROLES)}")
    return {"role": m["role"], "content": m["content"]}


def check_unique_ids(tasks: list[Task], where: str) -> None:
    seen: set[str] = set()
    for i, task in enumerate(tasks):
        if task.task_id in seen:
            raise TaskError(f"{where}: task id {task.task_id!r} appears twice (second at position {i})")
        seen.add(task.task_id)
