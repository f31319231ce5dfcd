"""`agentrl check --config F`: the example environment passes in seconds with its tool service
started, described and stopped, and no vLLM server; a bad task line, a tool command that exits and
a file missing from the config's folder each exit 2 naming the fix; a demonstration that calls a
tool the services do not offer is named."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def travel(tmp_path) -> Path:
    """A copy of examples/travel in a folder of its own."""
    folder = tmp_path / "travel"
    shutil.copytree(ROOT / "examples" / "travel", folder)
    return folder


def agentrl_check(config: Path, *sets: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-P", "-m", "agentrl.cli", "check", "--config", str(config), *(a for s in sets for a in ("--set", s))]
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=180)


def test_the_example_passes_from_another_folder_with_its_tool_service_stopped_after(travel, tmp_path, monkeypatch):
    from agentrl.check import check
    from agentrl.common.proctable import read_proc
    from agentrl.engine import serve
    from agentrl.runconfig import load_run_config

    def no_vllm(self):
        raise AssertionError("agentrl check started a vLLM server")

    monkeypatch.setattr(serve.VLLMServer, "start", no_vllm)
    monkeypatch.chdir(tmp_path)
    config = load_run_config(travel / "config.toml").config
    logs = tmp_path / "work"
    said: list[str] = []
    lines = asyncio.run(check(config, logs, say=said.append))
    assert lines[0].startswith("tasks: 60 held-out")
    assert lines[1].startswith("tools: find_flights, get_city, get_weather from tools[0]")
    assert any(line.startswith("demonstration (held-out travel-heldout-0): 2 actions, calls get_weather") for line in lines)
    assert any(line.startswith("demonstration (training ") for line in lines)
    # The tool service was started and is gone (by its PID).
    [started] = [line for line in said if line.startswith("tool service tools[0] #0: tcp://127.0.0.1:")]
    pid = int(started.rsplit("(pid ", 1)[1].rstrip(")"))
    assert read_proc(pid) is None and said[-1] == "stopped 1 tool service process"


def test_the_cli_passes_and_says_so(travel, tmp_path):
    proc = agentrl_check(Path("travel") / "config.toml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ok: travel/config.toml is ready to train" in proc.stdout
    assert "vLLM" not in proc.stdout + proc.stderr


def test_a_bad_task_line_is_named_with_its_file_and_line(travel, tmp_path):
    heldout = travel / "heldout.jsonl"
    heldout.write_text('{"id": "a", "prompt": "Weather in Paris?", "reference": "x"}\n{"id": "b", "prompt": 3}\n')
    (travel / "config.toml").write_text((travel / "config.toml").read_text().replace(
        'loader = "travel.py:load_tasks"', 'loader = "jsonl"').replace("seed = 0\nnum_heldout = 60", 'heldout = "heldout.jsonl"'))
    proc = agentrl_check(travel / "config.toml", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout
    assert f"{heldout}:2" in proc.stderr and "prompt" in proc.stderr


def test_a_tool_command_that_exits_is_named_with_its_log(travel, tmp_path):
    (travel / "tools.py").write_text("import sys\nprint('the service cannot start', file=sys.stderr)\nsys.exit(3)\n")
    proc = agentrl_check(travel / "config.toml", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout
    assert "tools[0].command" in proc.stderr and "did not start" in proc.stderr and "exited with 3" in proc.stderr
    assert "the service cannot start" in proc.stderr  # the log's tail is in the message
    logs = proc.stderr.rsplit("(tool service logs: ", 1)[1].split(")")[0]
    assert "the service cannot start" in (Path(logs) / "tool-command0-0.log").read_text()  # and the log is kept


def test_a_file_missing_from_the_configs_folder_is_named_with_that_folder(travel, tmp_path):
    (travel / "tools.py").rename(travel / "service.py")
    proc = agentrl_check(travel / "config.toml", cwd=tmp_path)
    assert proc.returncode == 2
    assert f"tools[0].command: no such file 'tools.py' in {travel}" in proc.stderr
    assert "relative paths in a config file are taken from the file's folder" in proc.stderr
    (travel / "travel.py").rename(travel / "env.py")
    proc = agentrl_check(travel / "config.toml", cwd=tmp_path)
    assert proc.returncode == 2 and f"no such file '{travel}/travel.py'" in proc.stderr


def test_a_demonstration_that_calls_a_tool_the_services_lack_is_named(travel, tmp_path):
    source = (travel / "travel.py").read_text()
    gold = 'self.parser.format_call(c["name"], c["arguments"])'
    assert gold in source
    (travel / "travel.py").write_text(source.replace(gold, 'self.parser.format_call(c["name"].replace("weather", "wether"), c["arguments"])'))
    proc = agentrl_check(travel / "config.toml", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout
    assert "the demonstration of held-out task 'travel-heldout-0'" in proc.stderr
    assert "unknown tool 'get_wether'" in proc.stderr


# Four configs that `check` once passed and that would each have wasted a whole run.
WASTEFUL = [
    pytest.param('return [*calls, self.parser.format_answer(json.dumps(task.reference))]',
                 'return [*calls, self.parser.format_answer(json.dumps({k: "nowhere" for k in task.reference}))]',
                 ["the demonstration of held-out task 'travel-heldout-0' scores correct = 0 when replayed with the real tools",
                  "below the environment's max_score = 1"], id="demonstrations-score-0"),
    pytest.param('        right = sum(', '        right = 1 / 0 + sum(',
                 ["the demonstration of held-out task 'travel-heldout-0' failed when replayed with the real tools",
                  "ZeroDivisionError: division by zero", "in reward"], id="reward-raises"),
    pytest.param('score_metric = "correct"', 'score_metric = "corect"',
                 ["score_metric = 'corect' is not among the metrics reward() returns (correct, fields_right, valid_json)"],
                 id="misspelt-score-metric"),
    pytest.param('report_by = ("kind",)', 'report_by = ("kind", "difficulty")',
                 ["report_by names 'difficulty', which no held-out task's metadata has"], id="report-by-in-no-task"),
]


@pytest.mark.parametrize(("old", "new", "said"), WASTEFUL)
def test_a_config_that_would_waste_a_run_exits_2_naming_why(travel, tmp_path, old, new, said):
    source = (travel / "travel.py").read_text()
    assert old in source
    (travel / "travel.py").write_text(source.replace(old, new))
    proc = agentrl_check(travel / "config.toml", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout
    for text in said:
        assert text in proc.stderr, proc.stderr


def test_the_demonstrations_are_scored_with_the_real_tools(travel, tmp_path):
    proc = agentrl_check(travel / "config.toml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "demonstration (held-out travel-heldout-0): 2 actions, calls get_weather" in proc.stdout
    assert proc.stdout.count("replayed with the real tools, correct = 1") == 2  # held-out and training
    assert "report by: kind" in proc.stdout


def test_more_demonstrations_than_the_task_set_holds_exit_2_before_a_run_spends_its_baseline(tmp_path):
    # Seen in a run: the SFT phase asked for 1,024 one-hop questions of a world with 1,008, after a
    # 3-minute baseline evaluation. `check` draws the whole pool now.
    proc = subprocess.run([sys.executable, "-P", "-m", "agentrl.cli", "check", "--set", "tasks.options.demonstration_hops=[1]"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and "sft.num_examples = 1024" in proc.stderr and "1008" in proc.stderr, proc.stderr[-2000:]
