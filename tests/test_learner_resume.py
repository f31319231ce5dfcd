"""Exactly-once consumption through a real learner subprocess: SIGKILL, restart, SIGTERM, restart.

Counts group ids: every group the orchestrator-side sender hands over is trained exactly once in the
lineage of the surviving checkpoints, including the groups trained after the last checkpoint before
the kill (replayed from the spool) and a duplicate resend (acknowledged, skipped).
"""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from support.synthetic import make_group, tiny_llama

from agentrl.common.transport import GroupSender
from agentrl.learner.checkpoint import load_latest_checkpoint
from agentrl.learner.metrics import read_metrics

GROUPS_PER_STEP = 2
MAX_STEPS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_config(tmp: Path, model_dir: Path, endpoint: str) -> Path:
    # One group = 2 samples x 25 tokens = 50 tokens; a 100-token budget takes exactly 2 groups per step.
    path = tmp / "learner.toml"
    path.write_text(f"""
output_dir = "{tmp / 'run'}"
model_dir = "{model_dir}"
tokens_per_step = 100
max_steps = {MAX_STEPS}
checkpoint.every = 3
publish.every = 0
staleness_bound = 100
transport.group_endpoint = "{endpoint}"
transport.version_endpoint = "tcp://127.0.0.1:{_free_port()}"
tensorboard = false
progress_bar = false

[trainer]
precision = "fp32"
max_row_tokens = 256

[trainer.optimizer]
lr = 1e-3

[reward_schedule]
process_start = 1.0
task_start = 1.0
process_end = 1.0
task_end = 1.0
""")
    return path


class LearnerProcess:
    def __init__(self, config: Path, log: Path):
        self.log = open(log, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "agentrl.cli", "learner", "--config", str(config)],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self.log.close()


async def _wait_step(run_dir: Path, step: int, proc: LearnerProcess, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.proc.poll() is None, f"learner exited early with {proc.proc.returncode}"
        if path.exists() and any(r["step"] >= step for r in read_metrics(path)):
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"learner did not reach step {step} in {timeout_s} s")


def _group(i: int):
    return make_group(f"grp-{i:03d}", [1.0, 0.0], prompt_len=5, turns=[(8, 4), (8, 0)], vocab_size=64, seed=i)


@pytest.mark.slow
async def test_sigkill_restart_trains_every_group_exactly_once(tmp_path):
    model_dir = tmp_path / "model"
    tiny_llama(vocab_size=64).save_pretrained(model_dir)
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    config = _write_config(tmp_path, model_dir, endpoint)
    run_dir = tmp_path / "run"
    groups = [_group(i) for i in range(MAX_STEPS * GROUPS_PER_STEP)]
    sender = GroupSender(endpoint, max_unacked=32)
    await sender.start()
    try:
        # Run 1: 5 steps, checkpoint at 3, then SIGKILL: steps 4-5 (groups 6..9) are lost with the weights.
        first = LearnerProcess(config, tmp_path / "learner.log")
        for g in groups[:10]:
            await sender.send(g)
        await _wait_step(run_dir, 5, first)
        os.killpg(first.proc.pid, signal.SIGKILL)
        assert first.wait_exit(30) == -signal.SIGKILL
        assert load_latest_checkpoint(run_dir / "checkpoints")["step"] == 3

        # Run 2: replays groups 6..9 from the spool, gets a duplicate of group 0, trains to step 6, SIGTERM.
        second = LearnerProcess(config, tmp_path / "learner.log")
        await sender.send(groups[0])  # a resend of a group the checkpoint already covers
        for g in groups[10:12]:
            await sender.send(g)
        await _wait_step(run_dir, 6, second)
        os.killpg(second.proc.pid, signal.SIGTERM)
        assert second.wait_exit(60) == 0
        assert load_latest_checkpoint(run_dir / "checkpoints")["step"] == 6

        # Run 3: nothing to replay; the rest arrives; stops at MAX_STEPS with a final checkpoint.
        third = LearnerProcess(config, tmp_path / "learner.log")
        for g in groups[12:]:
            await sender.send(g)
        assert third.wait_exit(120) == 0
        assert await sender.wait_all_acked(timeout_s=10)
    finally:
        await sender.close()

    log = (tmp_path / "learner.log").read_text()
    assert "READY learner step=3 replay=4" in log, log[-3000:]
    assert "READY learner step=6 replay=0" in log, log[-3000:]

    # The lineage: for a step that was redone after the kill, the later metrics line wins.
    lineage = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in lineage] == list(range(1, MAX_STEPS + 1))
    counts = Counter(gid for r in lineage for gid in r["group_ids"])
    assert counts == Counter({g.group_id: 1 for g in groups})
    raw_steps = Counter(int(line.split('"step": ')[1].split(",")[0].split("}")[0])
                        for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    assert raw_steps[4] == 2 and raw_steps[5] == 2 and raw_steps[6] == 1  # redone after the kill, only those

    final = load_latest_checkpoint(run_dir / "checkpoints")
    assert final["step"] == MAX_STEPS
    trained = final["ledger"]["trained"]
    assert sorted(trained) == sorted(g.group_id for g in groups)
    assert {gid: step for r in lineage for gid in r["group_ids"] for step in [r["step"]]} == trained
    assert not list((run_dir / "spool").glob("*.grp"))  # everything covered by the final checkpoint
    assert isinstance(final["policy"]["lm.model.embed_tokens.weight"], torch.Tensor)
