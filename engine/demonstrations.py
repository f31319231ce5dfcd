"""Demonstrations for the SFT cold start: a JSONL of recorded conversations, or the environment's own.

A demonstration line is {"task": {a task: engine/task.py}, "messages": [chat messages]}: the
conversation after the environment's system prompt, as a chat-completions client records it.
Its assistant messages are the policy's turns, written either in the environment's tool-call format
(`<tool_call>{...}</tool_call>`, `<answer>...</answer>`) or in OpenAI's (`tool_calls` with a
function name and JSON `arguments`; a final assistant message without tool calls is the answer).
They are replayed through the environment and its real tools (`episode.play`), so the trained
tokens are exactly what a sampled episode of this environment looks like; the recorded tool
messages are not used (the tools answer again). A line that does not replay to a complete episode
is an error naming the file and line.
"""

from __future__ import annotations

import json
from pathlib import Path

from agentrl.common.files import iter_jsonl
from agentrl.common.trajectory import Trajectory
from agentrl.engine.env import ToolEnv
from agentrl.engine.episode import play
from agentrl.engine.task import Task, TaskError


def assistant_turns(env: ToolEnv, messages: list[dict], where: str) -> list[str]:
    """The action text of each assistant message, in the environment's format."""
    turns = []
    assistant = [m for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
    if not assistant:
        raise TaskError(f"{where}: no assistant message to learn from")
    for k, m in enumerate(assistant):
        calls = m.get("tool_calls") or []
        text = m.get("content") or ""
        if calls:
            parts = [text] if text else []
            for call in calls:
                fn = call.get("function", call)
                args = fn.get("arguments", {})
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError as err:
                    raise TaskError(f"{where}: assistant message {k}: tool call arguments are not JSON ({err})") from None
                parts.append(env.parser.format_call(fn["name"], args))
            turns.append("".join(parts))
        elif k == len(assistant) - 1 and env.final_answer(env.parser.parse(text), text, True) is None:
            turns.append(env.parser.format_answer(text.strip()))  # a plain final message is the answer
        else:
            turns.append(text)
    return turns


async def read_demonstrations(env: ToolEnv, path: str | Path) -> list[Trajectory]:
    path = Path(path)
    out = []
    for number, (where, row) in enumerate(iter_jsonl(path, TaskError), 1):
        if not isinstance(row, dict) or "task" not in row or not isinstance(row.get("messages"), list):
            raise TaskError(f"{where}: a demonstration is {{\"task\": {{...}}, \"messages\": [...]}}")
        task = Task.from_json(row["task"], where)
        try:
            out.append(await play(env, task, assistant_turns(env, row["messages"], where), group_id=f"demo-{number}"))
        except ValueError as err:
            raise TaskError(f"{where}: {err}") from None
    return out
