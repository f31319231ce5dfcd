"""Time-zone questions answered with the `mcp-server-time` MCP server (PyPI), the real server as
the tool:

    agentrl train --config examples/mcp_time/config.toml

Tasks (generated, seeded: `load_tasks`): "A call starts at 14:30 in Tokyo (Asia/Tokyo). What time
is it then in London (Europe/London)? Answer as HH:MM." The metadata hold the two IANA zones and
the time; the reference is computed when it is needed, the way the server computes it (the time
on today's date in the source zone, converted with the zone rules of that date), so a question
stays right across daylight-saving changes.

The environment: the tools are the MCP server's own (`convert_time`, `get_current_time`, with the
server's names and JSON schemas), configured in config.toml as `[[tools]] mcp = [...]`; agentrl
train starts the server as a subprocess over stdio and stops it by PID. `reward` is 1 when the
HH:MM in <answer> is the converted time; `demonstration` calls `convert_time` with the task's
zones and time, then answers the converted time (the SFT cold start).
"""

from __future__ import annotations

import random
import re
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

from agentrl.common.config import config_dataclass
from agentrl.engine.env import EpisodeState, Reward, ToolEnv
from agentrl.engine.task import Task
from agentrl.engine.tasksets import TaskSet, generated_taskset

CITIES = {
    "Tokyo": "Asia/Tokyo", "London": "Europe/London", "New York": "America/New_York", "Paris": "Europe/Paris",
    "Sydney": "Australia/Sydney", "Los Angeles": "America/Los_Angeles", "Dubai": "Asia/Dubai",
    "Singapore": "Asia/Singapore", "Mumbai": "Asia/Kolkata", "Sao Paulo": "America/Sao_Paulo",
    "Moscow": "Europe/Moscow", "Cairo": "Africa/Cairo", "Chicago": "America/Chicago", "Berlin": "Europe/Berlin",
    "Seoul": "Asia/Seoul", "Mexico City": "America/Mexico_City", "Johannesburg": "Africa/Johannesburg",
    "Auckland": "Pacific/Auckland", "Bangkok": "Asia/Bangkok", "Toronto": "America/Toronto",
}
EVENTS = ["A call starts", "The train leaves", "A webinar begins", "The shop opens", "A match kicks off", "The flight lands"]

INTRO = ("You answer questions about time zones with the convert_time tool. Call it with the IANA zones given in "
         'the question: <tool_call>{"name": "convert_time", "arguments": {"source_timezone": "...", "time": "HH:MM", '
         '"target_timezone": "..."}}</tool_call>. Then reply <answer>HH:MM</answer> with the converted time.')

EXAMPLE_MESSAGES = (
    ("user", "The museum opens at 09:15 in Rome (Europe/Rome). What time is it then in Lima (America/Lima)? Answer as HH:MM."),
    ("assistant", '<tool_call>{"name": "convert_time", "arguments": {"source_timezone": "Europe/Rome", "time": "09:15", '
                  '"target_timezone": "America/Lima"}}</tool_call>'),
    ("tool", '<tool_response>\n{"source": {"timezone": "Europe/Rome", "datetime": "2026-01-15T09:15:00+01:00"}, '
             '"target": {"timezone": "America/Lima", "datetime": "2026-01-15T03:15:00-05:00"}, "time_difference": "-6.0h"}\n'
             "</tool_response>"),
    ("assistant", "<answer>03:15</answer>"),
)


def converted(source: str, time: str, target: str) -> str:
    """`time` (HH:MM) today in zone `source`, as HH:MM in zone `target` (mcp-server-time's rule)."""
    hours, minutes = map(int, time.split(":"))
    at = datetime.now(ZoneInfo(source)).replace(hour=hours, minute=minutes, second=0, microsecond=0)
    return at.astimezone(ZoneInfo(target)).strftime("%H:%M")


def question(rng: random.Random, index: int, split: str) -> Task:
    a, b = rng.sample(sorted(CITIES), 2)
    time = f"{rng.randrange(24):02d}:{rng.choice([0, 5, 10, 15, 20, 30, 40, 45, 50]):02d}"
    prompt = (f"{rng.choice(EVENTS)} at {time} in {a} ({CITIES[a]}). What time is it then in {b} ({CITIES[b]})? "
              "Answer as HH:MM.")
    return Task(f"tz-{split}-{index}", prompt=prompt,
                metadata={"source_timezone": CITIES[a], "time": time, "target_timezone": CITIES[b]})


@config_dataclass
class Options:
    seed: int = 0
    """Seed of the generated questions."""
    num_train: int = 2000
    """Training questions (cycled)."""
    num_heldout: int = 64
    """Held-out questions."""


def load_tasks(options: Options, workdir: Path) -> TaskSet:
    """Train and held-out questions from disjoint seeds."""
    return generated_taskset(options.seed, options.num_train, options.num_heldout, question)


load_tasks.Options = Options

_HHMM = re.compile(r"([01]?\d|2[0-3]):([0-5]\d)")


def expected(task: Task) -> str:
    m = task.metadata
    return converted(m["source_timezone"], m["time"], m["target_timezone"])


class TimeZoneEnv(ToolEnv):
    score_metric = "correct"

    def intro(self) -> str:
        return INTRO

    def example_messages(self):
        return EXAMPLE_MESSAGES

    def reward(self, task: Task, episode: EpisodeState) -> Reward:
        match = _HHMM.fullmatch(episode.answer.strip()) if isinstance(episode.answer, str) else None
        given = f"{int(match.group(1)):02d}:{match.group(2)}" if match else None
        correct = float(given == expected(task))
        return Reward(correct, {"correct": correct, "answered_time": float(given is not None)})

    def demonstration(self, task: Task) -> list[str]:
        m = task.metadata
        arguments = {"source_timezone": m["source_timezone"], "time": m["time"], "target_timezone": m["target_timezone"]}
        return [self.parser.format_call("convert_time", arguments), self.parser.format_answer(expected(task))]
