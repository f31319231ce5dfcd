"""Which training task the next group gets (a curriculum by pass rate), and whether the groups
still carry a learning signal.

A GRPO group teaches only when its samples' returns differ: a task every sample solves, or none
does, gives a group of equal returns, which dynamic sampling drops (an SFT policy at 0.94 made 96%
of its groups that way on a solved task). `PassRateCurriculum` wraps the task set's training stream
and keeps, per task, the pass rate of its last group (a sample passes when its task reward is at
least `pass_reward`):

- with probability `revisit_share` a draw revisits a task whose last group was mixed (pass rate
  strictly between 0 and 1), uniformly among the most recent `max_revisit_tasks` of them;
- otherwise it takes the stream's next task: one never tried, or whose last group was mixed, is
  taken; one whose last group all passed or all failed is taken with probability `floor` (the
  policy moves, so such a task may carry signal again) and skipped otherwise, at most `max_skips`
  in a row.

With every task unseen (the run's start) or none mixed, the draws are the stream's order, so the
curriculum changes nothing until groups show where the signal is. The stream's own order (the QA
loader's hop stages, `[tasks.options.curriculum]`) still decides which tasks exist to draw.

State (`state()` / `restore`): each task's attempts, passes and last pass rate, the mixed tasks
(whole, as task JSON), how many tasks were taken from the stream, and the random generator. A
sampler restored from a state draws exactly what the saved one would have drawn next, given the
same observations, because the stream is rebuilt and advanced by the count taken (the actor saves
the state after every observed group; engine/actor.py). Groups drawn but not observed when the
state was saved are not redrawn: they never finished.

`SignalMonitor` counts, over the most recent `window` groups, those whose samples all had the same
rewards (the learner drops them under dynamic sampling), and the groups since a sample last earned
task reward; the actor writes both to its stats and the supervisor reads them (`agentrl/phases/rl.py`:
the status line, and `[rl] stop_when_no_signal`).
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from agentrl.common.config import config_dataclass
from agentrl.common.trajectory import TrajectoryGroup
from agentrl.engine.task import Task

STATE_VERSION = 1


@config_dataclass
class CurriculumConfig:
    enabled: bool = True
    """Draw training tasks by pass rate (module docstring); false: the task set's stream as it is."""
    pass_reward: float = 1.0
    """A sample passes when its task reward is at least this (1.0: exact match for 0/1 rewards)."""
    revisit_share: float = 0.5
    """Share of draws that revisit a task whose last group was mixed (when there is one)."""
    floor: float = 0.2
    """Probability that a task whose last group all passed or all failed is taken again when the
    stream reaches it (0 would never retry it; 1 turns the skipping off)."""
    max_revisit_tasks: int = 256
    """Mixed tasks kept for revisits, the most recent first out of the set when it is full."""
    max_skips: int = 64
    """Tasks skipped in a row at most; the next one is taken whatever its pass rate."""
    seed: int = 0
    """Seed of the draws."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.revisit_share < 1.0:
            raise ValueError(f"revisit_share={self.revisit_share} must be in [0, 1) (1 would never draw a new task)")
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"floor={self.floor} must be in [0, 1]")
        if self.max_revisit_tasks < 1 or self.max_skips < 0:
            raise ValueError("max_revisit_tasks must be >= 1 and max_skips >= 0")


@dataclass
class TaskRecord:
    attempts: int = 0
    """Samples observed over every group of the task."""
    passes: int = 0
    """Of them, samples that passed."""
    last_rate: float = 0.0
    """Pass rate of the task's most recent group."""


def group_pass_rate(group: TrajectoryGroup, pass_reward: float) -> tuple[int, int] | None:
    """(passes, samples) over the group's non-failed samples; None when every sample failed
    (infrastructure: says nothing about the task)."""
    usable = [t for t in group.trajectories if t.status != "failed"]
    if not usable:
        return None
    return sum(t.task_reward >= pass_reward for t in usable), len(usable)


class PassRateCurriculum:
    def __init__(self, config: CurriculumConfig, stream: Callable[[], Iterator[Task]], state: dict | None = None):
        """`stream()` makes the task set's training stream afresh (it is advanced past what a
        restored `state` had taken)."""
        self.config = config
        self._source = stream()
        self._rng = random.Random(config.seed)
        self.records: dict[str, TaskRecord] = {}
        self.mixed: collections.OrderedDict[str, Task] = collections.OrderedDict()
        """Tasks whose last group was mixed, oldest first."""
        self._in_flight: dict[str, tuple[Task, int]] = {}
        """Task id -> (the task, groups of it drawn and not observed yet)."""
        self.num_taken = 0
        """Tasks taken from the stream (drawn or skipped)."""
        self.num_revisits = 0
        self.num_skipped = 0
        if state is not None:
            self._restore(state)

    # ---- drawing
    def draw(self) -> Task:
        cfg = self.config
        if self.mixed and self._rng.random() < cfg.revisit_share:
            task = self.mixed[self._rng.choice(list(self.mixed))]
            self.num_revisits += 1
        else:
            task = self._next_from_stream()
        held, count = self._in_flight.get(task.task_id, (task, 0))
        self._in_flight[task.task_id] = (held, count + 1)
        return task

    def stream(self) -> Iterator[Task]:
        while True:
            yield self.draw()

    def _next_from_stream(self) -> Task:
        for _ in range(self.config.max_skips):
            task = self._take()
            record = self.records.get(task.task_id)
            if record is None or 0.0 < record.last_rate < 1.0 or self._rng.random() < self.config.floor:
                return task
            self.num_skipped += 1
        return self._take()

    def _take(self) -> Task:
        self.num_taken += 1
        return next(self._source)

    # ---- observing
    def observe(self, group: TrajectoryGroup) -> None:
        """Record a finished group of a task this sampler drew."""
        task = self._release(group.task_id)
        counted = group_pass_rate(group, self.config.pass_reward)
        if counted is None:
            return
        passes, samples = counted
        record = self.records.setdefault(group.task_id, TaskRecord())
        record.attempts += samples
        record.passes += passes
        record.last_rate = passes / samples
        if 0 < passes < samples:
            self.mixed.pop(group.task_id, None)
            self.mixed[group.task_id] = task
            while len(self.mixed) > self.config.max_revisit_tasks:
                self.mixed.popitem(last=False)
        else:
            self.mixed.pop(group.task_id, None)

    def _release(self, task_id: str) -> Task:
        if task_id not in self._in_flight:
            raise KeyError(f"task {task_id!r} was not drawn by this curriculum (or was observed more often than drawn)")
        task, count = self._in_flight[task_id]
        if count == 1:
            del self._in_flight[task_id]
        else:
            self._in_flight[task_id] = (task, count - 1)
        return task

    # ---- summary and state
    def summary(self) -> dict[str, float]:
        """Scalars for the actor's stats: tasks seen, how many sit at 0, between, at 1."""
        rates = [r.last_rate for r in self.records.values()]
        return {"curriculum/tasks_seen": len(rates), "curriculum/tasks_mixed": len(self.mixed),
                "curriculum/tasks_all_pass": sum(r == 1.0 for r in rates),
                "curriculum/tasks_all_fail": sum(r == 0.0 for r in rates),
                "curriculum/revisits": self.num_revisits, "curriculum/skipped": self.num_skipped,
                "curriculum/taken": self.num_taken}

    def state(self) -> dict[str, Any]:
        version, internal, gauss = self._rng.getstate()
        return {"version": STATE_VERSION, "taken": self.num_taken, "revisits": self.num_revisits,
                "skipped": self.num_skipped,
                "records": {tid: [r.attempts, r.passes, r.last_rate] for tid, r in self.records.items()},
                "mixed": [task.to_json() for task in self.mixed.values()],
                "rng": [version, list(internal), gauss]}

    def _restore(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"curriculum state version {state.get('version')!r}; this agentrl reads {STATE_VERSION}")
        for _ in range(state["taken"]):
            next(self._source)
        self.num_taken, self.num_revisits, self.num_skipped = state["taken"], state["revisits"], state["skipped"]
        self.records = {tid: TaskRecord(int(a), int(p), float(r)) for tid, (a, p, r) in state["records"].items()}
        for obj in state["mixed"]:
            task = Task.from_json(obj, "curriculum state")
            self.mixed[task.task_id] = task
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))


class SignalMonitor:
    """Whether recent groups can still teach (module docstring)."""

    def __init__(self, window: int, pass_reward: float):
        self.window = window
        self.pass_reward = pass_reward
        self._recent_equal: collections.deque[bool] = collections.deque(maxlen=window)
        self.num_groups = 0
        self.num_equal = 0
        self.groups_since_task_reward = 0
        """Groups finished since a sample last earned a task reward above 0 (all groups, if none did)."""

    def observe(self, group: TrajectoryGroup) -> None:
        usable = [t for t in group.trajectories if t.status != "failed"]
        if not usable:
            return
        # Equal raw terms give equal returns under any reward weights: the learner drops the group.
        returns = {(round(sum(sum(turn.process_rewards.values()) for turn in t.turns), 6), round(t.task_reward, 6))
                   for t in usable}
        equal = len(returns) == 1
        self.num_groups += 1
        self.num_equal += equal
        self._recent_equal.append(equal)
        earned = any(t.task_reward > 0 for t in usable)
        self.groups_since_task_reward = 0 if earned else self.groups_since_task_reward + 1

    def summary(self) -> dict[str, float]:
        return {"signal/groups": self.num_groups, "signal/equal_groups": self.num_equal,
                "signal/recent_groups": len(self._recent_equal), "signal/recent_equal": sum(self._recent_equal),
                "signal/groups_since_task_reward": self.groups_since_task_reward}
