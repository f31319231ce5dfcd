"""`agentrl init-env DIR`: the folder it writes passes `agentrl check` and trains as written (end to
end on the real vLLM server and learner, 3 minutes, from another working directory); it refuses a
folder that holds files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def agentrl(*argv: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "agentrl.cli", *argv], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


def test_the_scaffold_passes_check_and_refuses_a_folder_with_files(tmp_path):
    made = agentrl("init-env", "shop", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in (tmp_path / "shop").iterdir()) == ["README.md", "config.toml", "environment.py", "tools.py"]
    readme = (tmp_path / "shop" / "README.md").read_text()
    assert "agentrl check --config shop/config.toml" in readme and "agentrl train --config shop/config.toml" in readme
    checked = agentrl("check", "--config", "shop/config.toml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert "tools: lookup from tools[0]" in checked.stdout and "ok: shop/config.toml is ready to train" in checked.stdout
    again = agentrl("init-env", "shop", cwd=tmp_path)
    assert again.returncode == 2 and "not an empty folder" in again.stderr
    assert (tmp_path / "shop" / "config.toml").read_text() == (
        Path(__file__).resolve().parents[1] / "agentrl" / "templates" / "env" / "config.toml").read_text()


@pytest.mark.run
@pytest.mark.slow
@pytest.mark.vllm
def test_the_scaffold_trains_as_written(tmp_path, shared_server):
    """init-env, check, then `agentrl train` from another folder on the session's server: the run's
    last line is its JSON summary with the scores (no learning target here). Only its size is cut:
    8 held-out tasks, 2 SFT steps and one RL step (without dynamic sampling, so that the step
    comes whatever the rewards), which ends the run before its budget."""
    assert agentrl("init-env", "envs/shop", cwd=tmp_path).returncode == 0
    assert agentrl("check", "--config", "envs/shop/config.toml", cwd=tmp_path).returncode == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = agentrl("train", "--config", "../envs/shop/config.toml", "--minutes", "8", "--out", "run",
                  "--vllm", shared_server.base_url, "--set", "tasks.options.num_heldout=8", "--set", "sft.steps=2",
                  "--set", "learner.max_steps=3", "--set", "learner.trainer.advantage.dynamic_sampling=false",
                  cwd=elsewhere, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["score_metric"] == "correct"
    assert summary["score_before"] is not None and summary["score_after"] is not None
    assert (elsewhere / "run" / "report.md").is_file()
    assert "tool service tools[0]" in run.stdout + run.stderr
    # The budget is an upper bound (on the slower kind 3 minutes ended before the RL step).
    assert summary["rl_steps"] + summary["sft_steps_done"] == 3 and "learner finished its max_steps" in run.stdout, \
        run.stdout[-3000:]
