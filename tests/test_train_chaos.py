"""Chaos: `agentrl train` over two vLLM servers, one SIGKILLed mid-RL. The run must finish on the
other (the orchestrator retires the dead server and retries its turns; the learner's push marks it
down and keeps pushing to the live one), print its JSON line, and lose no group: every group the
actor sent is trained exactly once (ledger = the groups listed by the surviving lineage's metrics),
and the final evaluation is served by the live server with a version of the RL lineage.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.learner.checkpoint import load_latest_checkpoint

CONFIG = """
minutes = 4.0
[tasks.options]
heldout_num = 4
heldout_hops = [1]
transfer_num = 0
num_train = 48
[services]
tools = ["search"]
[env]
max_turns = 2
max_action_tokens = 48
max_total_tokens = 2048
[orchestrator]
group_size = 4
max_concurrent_episodes = 16
max_groups_in_flight = 4
max_staleness = 2
[sft]
enabled = false
[learner]
anchor.coef = 0.0  # the demonstration anchor trains on the SFT cold start's demonstrations: none here
tokens_per_step = 2048
checkpoint.every = 1
staleness_bound = 8
max_steps = 5  # 3 steps after the kill, then RL ends rather than run out the budget
[learner.trainer]
train_layers = 1
train_embeddings = false
max_row_tokens = 2048
# No SFT: the untrained model seldom calls a tool, so nearly every group has equal rewards, and
# dynamic sampling could drop them all and leave no step to test (one run dropped all 79 groups).
[learner.trainer.advantage]
dynamic_sampling = false
[eval]
every_s = 100000.0
baselines = false
"""


def _metric_lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_train_finishes_when_one_of_two_servers_is_killed(tmp_path, model_dir):
    from agentrl.engine.serve import VLLMServer, VLLMServerConfig

    servers = [VLLMServer(VLLMServerConfig(model_dir=str(model_dir)), log_path=tmp_path / f"vllm{i}.log") for i in range(2)]
    try:
        for server in servers:
            server.start(timeout_s=float(os.environ.get("AGENTRL_TEST_VLLM_START_TIMEOUT_S", 400)))
        config = tmp_path / "chaos.toml"
        config.write_text(CONFIG)
        out = tmp_path / "run"
        argv = [sys.executable, "-P", "-m", "agentrl.cli", "train", "--config", str(config), "--out", str(out)]
        for server in servers:
            argv += ["--vllm", server.base_url]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            metrics = out / "rl" / "metrics.jsonl"
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline and len(_metric_lines(metrics)) < 2 and proc.poll() is None:
                time.sleep(1.0)
            assert len(_metric_lines(metrics)) >= 2, proc.stdout.read()[-3000:] if proc.poll() is not None else "no RL steps"
            servers[1]._proc.kill_group()  # SIGKILL the server, its engine core and workers
            output, _ = proc.communicate(timeout=1200)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        assert proc.returncode == 0, output[-4000:]
    finally:
        for server in servers:
            server.stop()

    summary = json.loads(output.strip().splitlines()[-1])
    assert summary["optimizer_steps"] >= 3 and summary["episodes"] > 0
    state = load_latest_checkpoint(out / "rl" / "checkpoints")
    final_step = int(state["step"])
    last_record_of_step = {r["step"]: r for r in _metric_lines(out / "rl" / "metrics.jsonl")}
    seen = [gid for step, r in sorted(last_record_of_step.items()) if step <= final_step for gid in r.get("group_ids", [])]
    assert len(seen) == len(set(seen)), "a group was trained at two steps"
    assert set(seen) == set(state["ledger"]["trained"])
    evals = [json.loads(x) for x in (out / "evals.jsonl").read_text().splitlines()]
    final = next(e for e in reversed(evals) if e["label"] == "final")  # the tool-disabled evaluation comes after it
    assert final["served_version"] > 0  # served by the live server, after pushes
