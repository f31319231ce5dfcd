"""The learner service under torchrun (2 ranks, gloo, FSDP2) against the same service in one process.

Real processes over the real ZeroMQ socket: a one-process `agentrl learner` and a
`torchrun --nproc_per_node 2 -m agentrl.cli learner` get the same 10 groups (2 per step, 5 steps).
The two-rank lineage is cut by a SIGTERM to the torchrun launcher after step 3 and resumed by a
second torchrun run. Checked: every step's loss and gradient norm equal the one-process run's
(the resumed steps 4-5 only do if model, optimizer and scheduler came back exactly), every group is
trained exactly once at the same step as in one process, the SIGTERM checkpoint is a 2-rank one,
after the SIGTERM no rank's process is left, and one process refuses to resume the 2-rank checkpoint.
"""

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from support.synthetic import make_group, tiny_llama

from agentrl.common.transport import GroupSender
from agentrl.engine.roles import TORCHRUN_ENV, torchrun_argv
from agentrl.learner.checkpoint import load_latest_checkpoint
from agentrl.learner.metrics import read_metrics

GROUPS_PER_STEP = 2
MAX_STEPS = 5
STOP_AFTER_STEP = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_config(path: Path, run_dir: Path, model_dir: Path, endpoint: str) -> Path:
    # One group = 2 samples x 25 tokens; a 100-token budget takes exactly 2 groups per step, and each
    # of the 2 ranks gets 2 of the 4 sequences. fp32 so that the two layouts agree to ~1e-6. The top
    # layer and final norm train (sharded, with sharded AdamW state) and the embedding and layer 0 are
    # frozen (kept whole on every rank): both kinds go through the gather, the checkpoint and the resume.
    path.write_text(f"""
output_dir = "{run_dir}"
model_dir = "{model_dir}"
tokens_per_step = 100
max_steps = {MAX_STEPS}
checkpoint.every = 2
publish.every = 0
staleness_bound = 100
transport.group_endpoint = "{endpoint}"
transport.version_endpoint = "tcp://127.0.0.1:{_free_port()}"
dist_timeout_s = 60.0
tensorboard = false
progress_bar = false

[trainer]
precision = "fp32"
max_row_tokens = 256
train_layers = 1
train_embeddings = false

[trainer.optimizer]
lr = 1e-3
""")
    return path


SYSTEM_PROMPT = np.array([3, 1, 4, 1, 5], dtype=np.int32)


def _group(i: int):
    group = make_group(f"grp-{i:03d}", [1.0, 0.0], prompt_len=5, turns=[(8, 4), (8, 0)], vocab_size=64, seed=i)
    for traj in group.trajectories:
        # Every sequence starts with the same prompt, as with a system prompt: a packed row's shared
        # prefix runs once through the frozen bottom layer (PackedPolicy.forward), sharded or not.
        traj.token_ids[: len(SYSTEM_PROMPT)] = SYSTEM_PROMPT
    return group


class Launched:
    """One learner launch (plain or torchrun). torchrun starts each rank in a session of its own,
    so a failed test stops the launcher (which stops its ranks) and then any rank left, by PID."""

    def __init__(self, argv: list[str], log: Path):
        self.argv = argv
        self.log_path = log
        self.log = open(log, "ab")  # noqa: SIM115 (closed in wait_exit)
        env = dict(os.environ, OMP_NUM_THREADS="1", **TORCHRUN_ENV)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self.log.close()

    def kill_all(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # torchrun: SIGTERM to the ranks, SIGKILL after 30 s
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        for pid in _rank_pids(self.log_path).values():
            if _alive(pid) and _is_learner(pid, self.argv[-1]):
                os.kill(pid, signal.SIGKILL)
        self.log.close()


def _plain(config: Path, log: Path) -> Launched:
    return Launched([sys.executable, "-P", "-m", "agentrl.cli", "learner", "--config", str(config)], log)


def _torchrun(config: Path, log: Path) -> Launched:
    return Launched([sys.executable, "-P", "-m", "torch.distributed.run", "--nproc_per_node", "2",
                     "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                     "-m", "agentrl.cli", "learner", "--config", str(config)], log)


async def _wait_for(predicate, launched: Launched, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        assert launched.proc.poll() is None, \
            f"learner exited early with {launched.proc.returncode}:\n{launched.log_path.read_text()[-3000:]}"
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{what} not seen in {timeout_s} s:\n{launched.log_path.read_text()[-3000:]}")


def _reached(run_dir: Path, step: int):
    path = run_dir / "metrics.jsonl"
    return lambda: path.exists() and any(r["step"] >= step for r in read_metrics(path))


def _rank_pids(log: Path) -> dict[int, int]:
    return {int(r): int(p) for r, p in re.findall(r"learner rank (\d+)/2 pid (\d+)", log.read_text())}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has exited; its parent just has not reaped it
    except FileNotFoundError:
        return False


def _is_learner(pid: int, config: str) -> bool:
    """Still a rank of this learner launch (not a process that has since reused the PID)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f"agentrl.cli\x00learner\x00--config\x00{config}".encode() in f.read()
    except FileNotFoundError:
        return False


async def _send_all(sender: GroupSender, groups) -> None:
    for g in groups:
        await sender.send(g)


@pytest.mark.slow
async def test_torchrun_service_matches_one_process_resumes_and_stops(tmp_path):
    model_dir = tmp_path / "model"
    tiny_llama(vocab_size=64).save_pretrained(model_dir)
    groups = [_group(i) for i in range(MAX_STEPS * GROUPS_PER_STEP)]
    launched: list[Launched] = []
    try:
        # The reference: the same service as one process, all groups, runs to MAX_STEPS.
        one_dir = tmp_path / "one"
        endpoint = f"tcp://127.0.0.1:{_free_port()}"
        one = _plain(_write_config(tmp_path / "one.toml", one_dir, model_dir, endpoint), tmp_path / "one.log")
        launched.append(one)
        sender = GroupSender(endpoint)
        await sender.start()
        try:
            await _send_all(sender, groups)
            assert one.wait_exit(180) == 0, (tmp_path / "one.log").read_text()[-3000:]
        finally:
            await sender.close()

        # Two ranks: steps 1-3, then SIGTERM to the launcher while rank 0 waits for data.
        two_dir = tmp_path / "two"
        endpoint = f"tcp://127.0.0.1:{_free_port()}"
        config = _write_config(tmp_path / "two.toml", two_dir, model_dir, endpoint)
        log = tmp_path / "two.log"
        first = _torchrun(config, log)
        launched.append(first)
        sender = GroupSender(endpoint)
        await sender.start()
        try:
            await _send_all(sender, groups[: STOP_AFTER_STEP * GROUPS_PER_STEP])
            await _wait_for(_reached(two_dir, STOP_AFTER_STEP), first, f"step {STOP_AFTER_STEP}")
            await _wait_for(lambda: len(_rank_pids(log)) == 2, first, "both ranks' pids")
            pids = _rank_pids(log)
            assert first.proc.pid not in pids.values()
            first.proc.send_signal(signal.SIGTERM)
            first.wait_exit(90)  # torchrun's own exit status after a forwarded signal is not ours to judge
            assert not [pid for pid in pids.values() if _alive(pid)], log.read_text()[-3000:]
            text = log.read_text()
            assert "learner: stopped at step 3" in text, text[-3000:]
            assert "learner rank 1: stopped at rank 0's request" in text, text[-3000:]
            saved = load_latest_checkpoint(two_dir / "checkpoints")
            assert saved["step"] == STOP_AFTER_STEP and saved["world_size"] == 2
            assert len(saved["rng_ranks"]) == 2

            # Resume under 2 ranks: step 3 and its ledger come back; the rest arrives; runs to MAX_STEPS.
            second = _torchrun(config, log)
            launched.append(second)
            await _wait_for(lambda: "READY learner step=3 replay=0" in log.read_text(), second, "resumed READY")
            await _send_all(sender, groups[STOP_AFTER_STEP * GROUPS_PER_STEP :])
            assert second.wait_exit(180) == 0, log.read_text()[-3000:]
            assert await sender.wait_all_acked(timeout_s=10)
        finally:
            await sender.close()

        # A different world size refuses the 2-rank checkpoint, saying how to resume it.
        mismatch = _plain(config, tmp_path / "mismatch.log")
        launched.append(mismatch)
        assert mismatch.wait_exit(120) != 0
        assert "resume it under torchrun --nproc_per_node 2" in (tmp_path / "mismatch.log").read_text()
    finally:
        for each in launched:
            each.kill_all()

    reference = read_metrics(one_dir / "metrics.jsonl")
    lineage = read_metrics(two_dir / "metrics.jsonl")
    assert [r["step"] for r in lineage] == [r["step"] for r in reference] == list(range(1, MAX_STEPS + 1))
    for ref, got in zip(reference, lineage, strict=True):
        assert got["group_ids"] == ref["group_ids"]
        assert got["action_tokens"] == ref["action_tokens"] and got["sequences"] == ref["sequences"] == 4
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4, abs=1e-6), (ref["step"], ref["loss"], got["loss"])
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), ref["step"]
    assert len({round(r["loss"], 6) for r in reference}) > 1  # the weights moved, so the later steps test the resume
    assert Counter(gid for r in lineage for gid in r["group_ids"]) == Counter({g.group_id: 1 for g in groups})

    final = load_latest_checkpoint(two_dir / "checkpoints")
    final_one = load_latest_checkpoint(one_dir / "checkpoints")
    assert final["step"] == final_one["step"] == MAX_STEPS
    assert final["ledger"]["trained"] == final_one["ledger"]["trained"]
    assert list(final["policy"]) == list(final_one["policy"])  # one layout for both: an init_checkpoint fits either
    for name, tensor in final_one["policy"].items():
        assert final["policy"][name].sub(tensor).abs().max().item() < 1e-5, name


@pytest.mark.slow
async def test_an_agent_killed_alone_takes_its_rank_and_the_other_rank_does_not_wait(tmp_path):
    """Two torchrun agents of one rank each (a static rendezvous, as on two hosts). SIGKILL agent 1
    alone while rank 0 waits for data, as when its node goes: its rank dies with it (it asked the
    kernel for that; torchrun starts it in a session of its own, so nothing else would stop it),
    and rank 0's next heartbeat finds the peer gone, so it exits and so does agent 0."""
    model_dir = tmp_path / "model"
    tiny_llama(vocab_size=64).save_pretrained(model_dir)
    config = _write_config(tmp_path / "two.toml", tmp_path / "run", model_dir, f"tcp://127.0.0.1:{_free_port()}")
    config.write_text(config.read_text().replace("dist_timeout_s = 60.0", "dist_timeout_s = 20.0"))  # heartbeat 5 s
    port = _free_port()
    learner = (sys.executable, "-P", "-m", "agentrl.cli", "learner", "--config", str(config))
    agents = [Launched(list(torchrun_argv(learner, nnodes=2, node_rank=i, nproc_per_node=1, master_addr="127.0.0.1",
                                          master_port=port)), tmp_path / f"agent{i}.log")
              for i in range(2)]
    try:
        await _wait_for(lambda: "READY learner step=0" in agents[0].log_path.read_text(), agents[0], "READY")
        rank1 = _rank_pids(agents[1].log_path)[1]
        rank0 = _rank_pids(agents[0].log_path)[0]
        os.kill(agents[1].proc.pid, signal.SIGKILL)
        agents[1].proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _alive(rank1) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not _alive(rank1), "rank 1 outlived its agent"
        deadline = time.monotonic() + 120  # a liveness bound, not a speed check: the heartbeat comes within 5 s
        while _alive(rank0) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        log = agents[0].log_path.read_text()
        assert not _alive(rank0), log[-3000:]
        assert "Connection closed by peer" in log or "Timed out" in log, log[-3000:]
        assert agents[0].wait_exit(60) != 0
    finally:
        for agent in agents:
            agent.kill_all()


@pytest.mark.vllm
@pytest.mark.slow
async def test_torchrun_learner_publishes_gathered_weights_to_vllm(vllm_server, model_dir, tmp_path):
    """SmolLM2 under 2 ranks pushes to the shared real vLLM server: rank 0 gathers the sharded
    weights after each step and the server ends up serving the learner's version 2."""
    from agentrl.common.inference import VLLMClient
    from agentrl.common.weights import push_weights

    run_dir = tmp_path / "run"
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    config = tmp_path / "learner.toml"
    # tokens_per_step = 1: one whole group per step. Only the top layer trains, to keep a step short.
    config.write_text(f"""
output_dir = "{run_dir}"
model_dir = "{vllm_server.model_dir}"
tokens_per_step = 1
max_steps = 2
publish.every = 1
checkpoint.every = 2
staleness_bound = 100
transport.group_endpoint = "{endpoint}"
transport.version_endpoint = "tcp://127.0.0.1:{_free_port()}"
server_urls = ["{vllm_server.base_url}"]
tensorboard = false
progress_bar = false

[trainer]
precision = "bf16"
train_layers = 1
train_embeddings = false
max_row_tokens = 1024

[trainer.optimizer]
lr = 1e-5
""")
    async with VLLMClient(vllm_server.base_url) as client:
        version_before = await client.weight_version()
    groups = [make_group(f"pub-{i}", [1.0, 0.0], prompt_len=6, turns=[(10, 4), (6, 0)], vocab_size=49152, seed=i)
              for i in range(2)]
    learner = _torchrun(config, tmp_path / "learner.log")
    sender = GroupSender(endpoint)
    try:
        await sender.start()
        await _send_all(sender, groups)
        returncode = await asyncio.to_thread(learner.wait_exit, 600)
        assert returncode == 0, (tmp_path / "learner.log").read_text()[-4000:]
        async with VLLMClient(vllm_server.base_url) as client:
            served = await client.weight_version()
    finally:
        learner.kill_all()
        await sender.close()
        await push_weights(vllm_server.base_url, model_dir / "model.safetensors", version_before)
    assert served == 2, f"server serves version {served}; the learner published 2"
    lineage = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in lineage] == [1, 2]
    assert [r["served_version"] for r in lineage][-1] >= 1  # the first push had landed by the end of step 2
    assert all("time/publish_stall_s" in r for r in lineage)
    assert "READY learner step=0 replay=0" in (tmp_path / "learner.log").read_text()
