"""The orchestrator: thousands of concurrent episodes, GRPO groups, staleness bound, backpressure.

One asyncio loop. For every task it starts a group of `group_size` episodes (samples of one prompt);
a group is emitted to the sink (the learner's `GroupSender.send`, a JSONL writer, a list) once all
its samples have finished.

Bounds (why memory stays flat):
- at most `max_concurrent_episodes` episodes run at once (a semaphore taken per episode);
- at most `max_groups_in_flight` groups exist between "started" and "accepted by the sink". The
  sink blocks when the learner falls behind (GroupSender backpressure), the group keeps its slot,
  and no new group starts: the orchestrator stops starting episodes rather than buffering them.
  Finished-but-unsent trajectories are thus bounded by max_groups_in_flight x group_size.

Staleness: with a `VersionSubscriber`, an episode starts only while
(learner version - served version) <= `max_staleness`; otherwise it waits for the servers to catch
up (weights pushed), at most `staleness_wait_s` before the run fails loudly.

Episodes: native by default (`episode.run_episode` on the environment); or whatever runs an
`EpisodeRunner`, `async (task, group_id, sample_index) -> list[Trajectory]`, such as an agent program
through the gateway (agentrl.gateway.agents). A runner's episode may give several trajectories (the
segments of one agent session), all with the member's `sample_index`; it gives a failed one rather
than raising. Both kinds run under the same bounds, staleness rule, failure rule and sink.

Nothing is dropped: every episode started returns a Trajectory (failed ones with status "failed"
and the reason, see `episode.run_episode`), every group reaches the sink, and `stats` counts
episodes started, finished, failed and groups emitted, so a report can check started == finished.
Failure rate: when more than `max_failure_rate` of the last `failure_window` finished episodes
failed (an environment that raises, tools or servers gone), the run stops with `TooManyFailures`,
carrying the count and the first failure's reason (a traceback for an environment's bug), instead
of streaming groups that cannot be trained. An exception escaping the orchestrator's own code (a
bug in the engine) cancels the run and is raised.

Garbage collection: with thousands of episodes alive, CPython's cyclic collector at its default
threshold (a young-generation pass every 700 net allocations) re-traverses the live episode state
again and again; in the capacity benchmark (1,024 episodes, stand-in server) it took about half of
the orchestrator's CPU (~740 us per turn at the default threshold, ~380 us at 200,000). A steady run
creates no cyclic garbage (a DEBUG_SAVEALL pass over a whole run collected 0 objects: episode state
is freed by reference counting), so `run` raises the young-generation threshold to
`gc_threshold0` for its duration and restores the previous thresholds afterwards.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from agentrl.common.config import config_dataclass
from agentrl.common.trajectory import Trajectory, TrajectoryGroup
from agentrl.common.transport import VersionSubscriber
from agentrl.engine.curriculum import CurriculumConfig
from agentrl.engine.env import ToolEnv
from agentrl.engine.episode import GenerateFn, SamplingConfig, run_episode
from agentrl.engine.task import Task

log = logging.getLogger(__name__)

Sink = Callable[[TrajectoryGroup], Awaitable[None]]
EpisodeRunner = Callable[[Task, str, int], Awaitable[list[Trajectory]]]
"""(task, group id, sample index) -> the episode's trajectories (at least one; failed ones marked)."""


@config_dataclass
class OrchestratorConfig:
    group_size: int = 8
    """Samples per prompt (GRPO's n)."""
    max_concurrent_episodes: int = 1024
    """Episodes running at once (each holds at most one generation request)."""
    max_groups_in_flight: int = 256
    """Groups started but not yet accepted by the sink; bounds memory when the sink blocks."""
    max_staleness: int = 1
    """k: start no episode while learner version - served version > k (policy versions)."""
    staleness_wait_s: float = 1800.0
    """Longest wait for the servers to catch up before the run fails, seconds."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    """Which training task the next group gets, by the pass rates of earlier groups (engine/curriculum.py)."""
    server_wait_s: float = 300.0
    """With every inference server down (one the run is starting again), how long an episode's
    request waits for one to answer before the episode fails, seconds (engine/pool.py)."""
    max_failure_rate: float = 0.2
    """Stop the run when more than this fraction of the last `failure_window` episodes failed."""
    failure_window: int = 50
    """Finished episodes the failure rate is measured over (the rule applies once that many finished)."""
    gc_threshold0: int | None = 100_000
    """Young-generation threshold of the cyclic garbage collector while `run` runs (net allocations
    between collections; CPython's default is 700); None leaves the collector as it is. See the
    module docstring for why."""

    def __post_init__(self) -> None:
        if self.gc_threshold0 is not None and self.gc_threshold0 < 1:
            raise ValueError("OrchestratorConfig.gc_threshold0 must be >= 1 (or None to leave the collector alone)")
        if self.group_size < 1 or self.max_concurrent_episodes < 1 or self.max_groups_in_flight < 1:
            raise ValueError("OrchestratorConfig: group_size, max_concurrent_episodes and max_groups_in_flight must be >= 1")
        if self.max_staleness < 0:
            raise ValueError("max_staleness: must be >= 0")
        if self.server_wait_s < 0:
            raise ValueError(f"server_wait_s: {self.server_wait_s} must be >= 0")
        if not 0.0 <= self.max_failure_rate <= 1.0 or self.failure_window < 1:
            raise ValueError("max_failure_rate: must be in [0, 1] (1 = never stop), with failure_window >= 1")


@dataclass
class OrchestratorStats:
    num_episodes_started: int = 0
    num_episodes_finished: int = 0
    num_episodes_failed: int = 0
    num_groups_emitted: int = 0
    num_turns: int = 0
    num_action_tokens: int = 0
    staleness_wait_s: float = 0.0
    wall_s: float = 0.0


class TooManyFailures(RuntimeError):
    """Too many episodes failed in a row of the run (see the module docstring)."""


class Orchestrator:
    def __init__(self, env: ToolEnv, generate: GenerateFn, sink: Sink, config: OrchestratorConfig | None = None, *,
                 versions: VersionSubscriber | None = None, run_id: str | None = None,
                 episodes: EpisodeRunner | None = None):
        self.env = env
        self.generate = generate
        self.sink = sink
        self.config = config or OrchestratorConfig()
        self.versions = versions
        self.run_id = run_id or uuid.uuid4().hex[:12]
        """Prefix of every group id: unique across runs and restarts, so the learner's dedup is sound."""
        self.episodes = episodes or self._native_episode
        """Runs one group member: native episodes unless a runner is given (module docstring)."""
        self.stats = OrchestratorStats()
        self._recent_failed: collections.deque[bool] = collections.deque(maxlen=self.config.failure_window)
        self._first_failure: str | None = None
        self._episode_slots = asyncio.Semaphore(self.config.max_concurrent_episodes)
        self._group_slots = asyncio.Semaphore(self.config.max_groups_in_flight)

    async def run(self, tasks: Iterable[Task]) -> OrchestratorStats:
        """Run a group for every task; returns once every group has been accepted by the sink."""
        start = time.perf_counter()
        running: set[asyncio.Task] = set()
        failure: list[BaseException] = []
        gc_thresholds = gc.get_threshold()
        if self.config.gc_threshold0 is not None:
            gc.set_threshold(self.config.gc_threshold0, *gc_thresholds[1:])

        def done(task: asyncio.Task) -> None:
            running.discard(task)
            self._group_slots.release()
            if not task.cancelled() and task.exception() is not None:
                failure.append(task.exception())

        try:
            for index, task in enumerate(tasks):
                await self._group_slots.acquire()
                if failure:
                    self._group_slots.release()
                    break
                group_task = asyncio.create_task(self._run_group(task, f"{self.run_id}-{index}-{task.task_id}"))
                running.add(group_task)
                group_task.add_done_callback(done)
            if running:
                await asyncio.wait(set(running))
        finally:
            for t in list(running):
                t.cancel()
            if running:
                await asyncio.wait(set(running), timeout=10.0)
            gc.set_threshold(*gc_thresholds)
            self.stats.wall_s = time.perf_counter() - start
        if failure:
            raise failure[0]
        return self.stats

    async def _run_group(self, task: Task, group_id: str) -> None:
        members = await asyncio.gather(*(self._run_sample(task, group_id, i) for i in range(self.config.group_size)))
        await self.sink(TrajectoryGroup(group_id=group_id, task_id=task.task_id, trajectories=[t for m in members for t in m]))
        self.stats.num_groups_emitted += 1

    async def _native_episode(self, task: Task, group_id: str, sample_index: int) -> list[Trajectory]:
        return [await run_episode(self.env, task, self.generate, self.config.sampling, group_id=group_id,
                                  sample_index=sample_index)]

    async def _run_sample(self, task: Task, group_id: str, sample_index: int) -> list[Trajectory]:
        await self._wait_fresh_enough()
        async with self._episode_slots:
            self.stats.num_episodes_started += 1
            trajs = await self.episodes(task, group_id, sample_index)
        if not trajs:
            raise RuntimeError(f"the episode runner returned no trajectory for {group_id}/{sample_index}")
        self.stats.num_episodes_finished += 1
        self.stats.num_turns += sum(len(t.turns) for t in trajs)
        self.stats.num_action_tokens += sum(int(t.is_action.sum()) for t in trajs)
        failure = next((t for t in trajs if t.status == "failed"), None)
        self._recent_failed.append(failure is not None)
        if failure is not None:
            self.stats.num_episodes_failed += 1
            self._first_failure = self._first_failure or f"task {task.task_id}: {failure.error}"
            log.warning("episode %s/%d failed: %s", group_id, sample_index, failure.error)
            window = self._recent_failed
            if len(window) == window.maxlen and sum(window) > self.config.max_failure_rate * len(window):
                raise TooManyFailures(f"{sum(window)} of the last {len(window)} episodes failed "
                                      f"({self.stats.num_episodes_failed} of {self.stats.num_episodes_finished} in all); "
                                      f"the first: {self._first_failure}")
        return trajs

    async def _wait_fresh_enough(self) -> None:
        if self.versions is None:
            return
        k = self.config.max_staleness
        latest = self.versions.latest
        if latest is not None and latest[0] - latest[1] <= k:
            return
        start = time.perf_counter()
        try:
            await self.versions.wait_until(lambda v: v[0] - v[1] <= k, timeout_s=self.config.staleness_wait_s)
        except TimeoutError:
            raise RuntimeError(f"servers stayed more than {k} versions behind the learner (latest {self.versions.latest}) "
                               f"for {self.config.staleness_wait_s} s; is the weight push failing?") from None
        finally:
            self.stats.staleness_wait_s += time.perf_counter() - start
