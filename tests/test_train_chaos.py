"""Chaos: `agentrl train` over two vLLM servers, one SIGKILLed mid-RL (and without SFT: it reads no demonstration). The run must finish on the
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
import time
from pathlib import Path

import pytest
from support.runs import train_argv

from agentrl.learner.checkpoint import load_latest_checkpoint

NO_DEMONSTRATION_ENV = Path(__file__).resolve().parent / "fixtures" / "envs" / "no_demonstration.py:NoDemonstrationQAEnv"


def _metric_lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.run
@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_train_finishes_when_one_of_two_servers_is_killed(tmp_path, model_dir, shared_server):
    from agentrl.engine.serve import VLLMServer, VLLMServerConfig

    # The survivor is the session's server; the doomed one is started here.
    doomed = VLLMServer(VLLMServerConfig(model_dir=str(model_dir), kv_cache_gib=1.5), log_path=tmp_path / "doomed.log")
    try:
        doomed.start(timeout_s=float(os.environ.get("AGENTRL_TEST_VLLM_START_TIMEOUT_S", 400)))
        out = tmp_path / "run"
        # RL ends at step 5: 3 steps after the kill, rather than run out the budget. And a run without
        # SFT reads no demonstration: its environment's demonstration() raises, and the anchor's
        # coefficient, set, is turned off by the one key sft.enabled = false.
        argv = train_argv("learner.max_steps=5", f'env.class="{NO_DEMONSTRATION_ENV}"', "learner.anchor.coef=0.3",
                          out=out, extra=("--vllm", shared_server.base_url, "--vllm", doomed.base_url))
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            metrics = out / "rl" / "metrics.jsonl"
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline and len(_metric_lines(metrics)) < 2 and proc.poll() is None:
                time.sleep(1.0)
            assert len(_metric_lines(metrics)) >= 2, proc.stdout.read()[-3000:] if proc.poll() is not None else "no RL steps"
            doomed._proc.kill_group()  # SIGKILL the server, its engine core and workers
            output, _ = proc.communicate(timeout=1200)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        assert proc.returncode == 0, output[-4000:]
    finally:
        doomed.stop()

    assert "demonstration anchor off" in output  # and the environment was never asked for a demonstration
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
