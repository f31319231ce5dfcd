"""RL that has no learning signal says so and stops (`[rl] stop_when_no_signal`), and the actor keeps
the curriculum's state for a resume.

A real tiny run (tests/tiny_run.toml) on the session's server, the untrained model without its worked
example: it calls no tool and ends without an answer, so every sample of a group earns the same
rewards, dynamic sampling drops the groups, and after `rl.no_signal_groups` of them the run ends its
RL phase early and says why, in its log, its report and its JSON line.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from support.runs import train_argv

from agentrl.engine.curriculum import PassRateCurriculum
from agentrl.engine.tasksets import load_taskset
from agentrl.phases.rl import no_signal
from agentrl.report import signal_text
from agentrl.runconfig import RLConfig, load_run_config


def test_no_signal_needs_a_full_window_of_equal_groups():
    rl = RLConfig(no_signal_groups=8, no_signal_share=0.75)
    assert no_signal({}, rl) is None
    assert no_signal({"signal/recent_groups": 7, "signal/recent_equal": 7}, rl) is None  # the window is not full yet
    assert no_signal({"signal/recent_groups": 8, "signal/recent_equal": 5}, rl) is None
    assert no_signal({"signal/recent_groups": 8, "signal/recent_equal": 6}, rl) == \
        "6 of the last 8 groups had the same rewards in every sample"


def test_the_status_text_names_equal_groups_and_groups_without_task_reward():
    assert signal_text({}) == []
    assert signal_text({"signal/recent_groups": 48, "signal/recent_equal": 46, "signal/groups_since_task_reward": 3}) == [
        "46 of the last 48 groups without signal (equal rewards)"]
    assert signal_text({"signal/recent_groups": 48, "signal/recent_equal": 2, "signal/groups_since_task_reward": 60})[1] == \
        "no episode has earned task reward in the last 60 groups"


def test_one_key_turns_a_run_to_rewards_alone():
    """`sft.enabled = false` alone: the worked example ("auto") is shown, the anchor is turned off by
    the RL phase (tests/test_learner_anchor.py); with SFT it is not shown; an explicit value wins."""
    default = load_run_config().config
    assert default.sft.enabled and default.env.worked_example is False
    alone = load_run_config(sets=["sft.enabled=false"]).config
    assert alone.env.worked_example is True and alone.env.shows_worked_example
    assert alone.env.options["worked_examples"] == [2, 1]  # the 2-hop example, then the 1-hop one
    assert load_run_config(sets=["sft.enabled=false", "env.worked_example=false"]).config.env.worked_example is False
    assert load_run_config(sets=["env.worked_example=true"]).config.env.worked_example is True


@pytest.mark.run
@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_a_run_without_signal_stops_its_rl_phase_and_says_why(tmp_path, shared_server):
    out = tmp_path / "run"
    run = subprocess.run(train_argv("env.worked_example=false", "learner.trainer.advantage.dynamic_sampling=true",
                                    "rl.no_signal_groups=8", "rl.no_signal_share=0.75", "minutes=10.0", out=out,
                                    extra=("--vllm", shared_server.base_url)),
                         capture_output=True, text=True, timeout=840)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert "RL stopped: no learning signal left (" in run.stdout, run.stdout[-3000:]
    assert summary["rl_stopped_reason"] == "no_signal"
    assert summary["rl_minutes"] < 6.0  # it did not wait for its budget
    assert summary["groups_dropped_equal_share"] >= 0.5
    assert "RL ended because no learning signal was left" in (out / "report.md").read_text()
    # The curriculum's state, saved by the actor after every group, restores a sampler over the
    # run's own training stream (the exactness of a restore: tests/test_engine_curriculum.py).
    state = json.loads((out / "actor" / "curriculum.json").read_text())
    assert state["records"] and state["taken"] >= len(state["records"])
    config = load_run_config(out / "config.toml").config
    taskset = load_taskset(config.tasks, tmp_path / "tasks")
    restored = PassRateCurriculum(config.orchestrator.curriculum, lambda: taskset.train_stream(lambda: 0), state=state)
    assert restored.state() == state
