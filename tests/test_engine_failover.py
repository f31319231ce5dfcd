"""Killing a vLLM server mid-run loses no episode: its in-flight turns are retried on the surviving
server, and with no server left the episodes are reported failed, never dropped."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.engine.chat import ChatFormat
from agentrl.engine.env import EnvConfig
from agentrl.engine.episode import SamplingConfig
from agentrl.engine.orchestrator import Orchestrator, OrchestratorConfig
from agentrl.engine.pool import ServerPool
from agentrl.engine.tools import LocalSearchTool
from agentrl.envs.multihop_qa.env import MultiHopQAEnv
from agentrl.envs.multihop_qa.tasks import SyntheticQAConfig, synthetic_tasks

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


async def test_killed_server_loses_no_episode(vllm_server, tokenizer, model_dir, tmp_path):
    from agentrl.engine.serve import VLLMServer, VLLMServerConfig

    world, tasks = synthetic_tasks(num=6, config=SyntheticQAConfig(num_companies=50))
    env = MultiHopQAEnv(ChatFormat(tokenizer), EnvConfig(max_turns=2, max_action_tokens=48))
    env.register_tool(LocalSearchTool(world.passages))
    doomed = VLLMServer(VLLMServerConfig(model_dir=str(model_dir), max_model_len=2048, gpu_memory_utilization=0.2,
                                         kv_cache_gib=1.0),
                        log_path=tmp_path / "doomed.log")
    await asyncio.to_thread(doomed.start, 400.0)
    try:
        groups = []

        async def sink(group):
            groups.append(group)

        config = OrchestratorConfig(group_size=4, max_concurrent_episodes=16, sampling=SamplingConfig(temperature=1.0, seed=3))
        async with ServerPool([doomed.base_url, vllm_server.base_url], probe_interval_s=3600) as pool:
            doomed_state = pool.servers[0]

            async def kill_when_busy():
                while not (doomed_state.outstanding >= 2 and doomed_state.num_requests >= 4):
                    await asyncio.sleep(0.05)
                doomed.kill()

            killer = asyncio.create_task(kill_when_busy())
            stats = await Orchestrator(env, pool.generate, sink, config).run(tasks[:3])
            await asyncio.wait_for(killer, 5)
            assert pool.live_servers == [vllm_server.base_url]
            assert pool.num_retries >= 1  # in-flight turns of the dead server were regenerated elsewhere
        trajectories = [t for g in groups for t in g.trajectories]
        assert stats.num_episodes_started == stats.num_episodes_finished == len(trajectories) == 12
        assert sorted((t.group_id, t.sample_index) for t in trajectories) == sorted({(t.group_id, t.sample_index) for t in trajectories})
        assert stats.num_episodes_failed == 0 and all(t.status in ("ok", "truncated") for t in trajectories)

        # No server left: every episode comes back marked failed, with the reason.
        groups.clear()
        async with ServerPool([doomed.base_url], probe_interval_s=3600) as dead_pool:
            stats = await Orchestrator(env, dead_pool.generate, sink, config).run(tasks[3:4])
        failed = [t for g in groups for t in g.trajectories]
        assert len(failed) == stats.num_episodes_failed == 4
        assert all(t.status == "failed" and "inference failed" in t.error for t in failed)
    finally:
        doomed.stop()
