"""Orchestrator bounds: staleness gate on the learner's published versions, and backpressure from an
unacknowledging learner (real ZeroMQ transport; a scripted policy stands in for generation)."""

from __future__ import annotations

import asyncio
import gc
import socket

import pytest
from transformers import AutoTokenizer

from agentrl.common.inference import Generation
from agentrl.common.model import prepare_model
from agentrl.common.transport import GroupReceiver, GroupSender, VersionPublisher, VersionSubscriber
from agentrl.engine.chat import ChatFormat
from agentrl.engine.env import EnvConfig, ToolEnv
from agentrl.engine.orchestrator import Orchestrator, OrchestratorConfig
from agentrl.engine.tools import LocalSearchTool
from agentrl.envs.multihop_qa.env import MultiHopQAEnv
from agentrl.envs.multihop_qa.tasks import SyntheticQAConfig, synthetic_tasks


def endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def env_tasks():
    world, tasks = synthetic_tasks(num=12, config=SyntheticQAConfig(num_companies=40))
    env = MultiHopQAEnv(ChatFormat(AutoTokenizer.from_pretrained(prepare_model())), EnvConfig(max_turns=2))
    env.register_tool(LocalSearchTool(world.passages))
    return env, tasks


def answering_policy(env: ToolEnv, calls: list[int]):
    ids = [*env.chat.encode("<answer>x</answer>"), env.chat.im_end_id]

    async def generate(prompt_ids, params):
        calls.append(1)
        await asyncio.sleep(0)
        return Generation(ids, [-0.5] * len(ids), "stop", [0] * len(ids), "scripted")

    return generate


async def test_no_episode_starts_while_servers_are_too_stale(env_tasks):
    env, tasks = env_tasks
    ep = endpoint()
    pub, sub = VersionPublisher(ep, republish_interval_s=0.05), VersionSubscriber(ep)
    await pub.start()
    await sub.start()
    calls: list[int] = []
    groups = []

    async def sink(group):
        groups.append(group)

    try:
        await pub.publish(5, 2)  # learner 3 versions ahead of what the servers serve; k = 1
        await sub.wait_until(lambda v: v == (5, 2), timeout_s=10)
        orch = Orchestrator(env, answering_policy(env, calls), sink, OrchestratorConfig(group_size=2, max_staleness=1), versions=sub)
        run = asyncio.create_task(orch.run(tasks[:2]))
        await asyncio.sleep(0.5)
        assert calls == [] and orch.stats.num_episodes_started == 0
        await pub.publish(5, 4)  # weights pushed: within the bound
        await asyncio.wait_for(run, 10)
        assert orch.stats.num_episodes_finished == 4 and len(groups) == 2 and orch.stats.staleness_wait_s > 0.4
    finally:
        await sub.close()
        await pub.close()


async def test_learner_that_stops_acking_stops_new_episodes(env_tasks):
    env, tasks = env_tasks
    ep = endpoint()
    receiver, sender = GroupReceiver(ep), GroupSender(ep, max_unacked=2)
    await receiver.start()
    await sender.start()
    calls: list[int] = []
    config = OrchestratorConfig(group_size=2, max_groups_in_flight=3, max_concurrent_episodes=64)
    orch = Orchestrator(env, answering_policy(env, calls), sender.send, config)
    run = asyncio.create_task(orch.run(tasks))  # 12 groups
    try:
        await asyncio.sleep(1.0)
        # 2 groups sent and unacked + 3 groups holding their slots (1 blocked in send, 2 waiting): nothing more starts.
        assert sender.num_unacked == 2
        assert orch.stats.num_episodes_started == (2 + 3) * 2
        received = []
        while len(received) < len(tasks):  # the learner catches up: everything flows, each group once
            r = await asyncio.wait_for(receiver.recv(), 10)
            if r.group.group_id not in {g.group_id for g in received}:
                received.append(r.group)
            await receiver.ack(r)
        await asyncio.wait_for(run, 10)
        assert orch.stats.num_episodes_finished == 24 and {len(g.trajectories) for g in received} == {2}
    finally:
        run.cancel()
        await sender.close()
        await receiver.close()


async def test_collector_threshold_is_raised_during_a_run_and_restored(env_tasks):
    env, tasks = env_tasks
    seen: list[int] = []
    ids = [*env.chat.encode("<answer>x</answer>"), env.chat.im_end_id]

    async def generate(prompt_ids, params):
        seen.append(gc.get_threshold()[0])
        return Generation(ids, [-0.5] * len(ids), "stop", [0] * len(ids), "scripted")

    async def sink(group):
        pass

    before = gc.get_threshold()
    await Orchestrator(env, generate, sink, OrchestratorConfig(group_size=2, gc_threshold0=123_456)).run(tasks[:2])
    assert seen == [123_456] * 4 and gc.get_threshold() == before
    seen.clear()
    await Orchestrator(env, generate, sink, OrchestratorConfig(group_size=1, gc_threshold0=None)).run(tasks[:1])
    assert seen == [before[0]] and gc.get_threshold() == before
    with pytest.raises(ValueError, match="gc_threshold0"):
        OrchestratorConfig(gc_threshold0=0)


class RaisingRewardEnv(MultiHopQAEnv):
    """A user environment with a bug: `reward` raises for the tasks named in `bad`."""

    bad: set[str] = set()

    def reward(self, task, episode):
        if task.task_id in self.bad:
            raise KeyError(f"no reference for {task.task_id}")
        return super().reward(task, episode)


def _raising_env(env_tasks, bad: set[str]) -> RaisingRewardEnv:
    base, tasks = env_tasks
    env = RaisingRewardEnv(base.chat, EnvConfig(max_turns=2))
    env.bad = bad
    for tool in base.tools.values():
        env.register_tool(tool)
    return env


async def test_an_environment_that_raises_fails_only_its_episodes_and_the_run_goes_on(env_tasks):
    _, tasks = env_tasks
    env = _raising_env(env_tasks, {tasks[1].task_id})
    groups = []

    async def sink(group):
        groups.append(group)

    orch = Orchestrator(env, answering_policy(env, []), sink,
                        OrchestratorConfig(group_size=2, max_failure_rate=0.2, failure_window=50))
    stats = await asyncio.wait_for(orch.run(tasks), 30)
    assert stats.num_episodes_failed == 2 and len(groups) == len(tasks)  # one task's two samples; every group sent
    failed = [t for g in groups for t in g.trajectories if t.status == "failed"]
    assert {t.task_id for t in failed} == {tasks[1].task_id}
    assert all("Traceback" in t.error and "KeyError: 'no reference for" in t.error for t in failed)
    # Not trained on: the learner's batch preparation drops failed samples and counts them.
    from agentrl.learner.advantages import AdvantageConfig
    from agentrl.learner.prepare import prepare_batch
    from agentrl.learner.rewards import RewardWeights

    batch = prepare_batch(groups, version=0, mode="rl", staleness_bound=None, weights=RewardWeights(),
                          advantage=AdvantageConfig())
    assert batch.report["samples/failed"] == 2 and all(s.trajectory.status != "failed" for s in batch.samples)


async def test_past_the_failure_rate_the_run_stops_with_the_first_traceback_and_the_count(env_tasks):
    from agentrl.engine.orchestrator import TooManyFailures

    _, tasks = env_tasks
    env = _raising_env(env_tasks, {t.task_id for t in tasks[::2]})  # half the tasks: 50% > 20%

    async def sink(group):
        pass

    orch = Orchestrator(env, answering_policy(env, []), sink,
                        OrchestratorConfig(group_size=2, max_failure_rate=0.2, failure_window=10))
    with pytest.raises(TooManyFailures) as err:
        await asyncio.wait_for(orch.run(tasks * 3), 30)
    assert "of the last 10 episodes failed" in str(err.value) and "KeyError" in str(err.value)
    assert f"task {tasks[0].task_id}" in str(err.value)  # the first failure's task and traceback
