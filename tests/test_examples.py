"""The example environments (examples/*/) work as `agentrl train --config examples/X/config.toml`
would start them, with their real tools: the config resolves over the embedded default (every
plug-in imports, every option validates), the tasks load, train's own service start-up hosts the
tools (the calculator service; the travel example's own tool service from its command; the real
`mcp-server-time` MCP server over stdio), the
environment's gold demonstration played through those tools scores 1, and a wrong answer 0.
Training them is measured, not tested (their READMEs give the figures and the commands).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {"arithmetic": {"calculator"}, "travel": {"get_weather", "find_flights", "get_city"},
            "mcp_time": {"convert_time", "get_current_time"}}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_plays_its_demonstrations_through_its_real_tools(name, tmp_path, tokenizer, monkeypatch):
    from agentrl.common.proctable import read_proc
    from agentrl.engine.episode import play
    from agentrl.engine.services import Connections, start_services
    from agentrl.engine.tasksets import load_taskset
    from agentrl.runconfig import load_run_config

    monkeypatch.chdir(tmp_path)  # the configs name their files relative to their own folders
    config = load_run_config(ROOT / "examples" / name / "config.toml").config
    assert config.minutes <= 20  # the budget: +0.15 within 20 minutes after set-up
    taskset = load_taskset(config.tasks, tmp_path / "run")
    assert len(taskset.heldout) >= 50
    no_server = dataclasses.replace(config.services, vllm=["http://127.0.0.1:9"])  # scripted turns: never called

    async def run():
        from agentrl.engine.environments import env_class

        services = await start_services(no_server, tools=config.tools, env_required=env_class(config.env).required_tools,
                                        model_dir="", corpus=None, logs=tmp_path / "logs")
        try:
            async with Connections(services.vllm_urls, services.remote, str(tokenizer.name_or_path), config.env,
                                   services.local) as conn:
                assert set(conn.env.tools) == EXAMPLES[name]
                right = [await play(conn.env, task, conn.env.demonstration(task), group_id=f"d{i}")
                         for i, task in enumerate(taskset.heldout[:6])]
                task = taskset.heldout[0]
                wrong = await play(conn.env, task, [*conn.env.demonstration(task)[:-1], "<answer>-1</answer>"], group_id="w")
                mcp_pids = [server.pid for server in conn.mcp_servers]
            return right, wrong, services.procs, mcp_pids
        finally:
            services.stop()

    right, wrong, procs, mcp_pids = asyncio.run(run())
    for traj in right:
        assert traj.status == "ok" and traj.task_reward == 1.0, (traj.status, traj.task_reward, traj.error)
        assert traj.metrics["process/tool_success"] > 0  # the hosted tools answered
    assert wrong.task_reward == 0.0
    assert all(p.poll() is not None for p in procs), "a tool service outlived the run"
    assert all(isinstance(pid, int) and read_proc(pid) is None for pid in mcp_pids), "an MCP server outlived the run"
    assert len(procs) + len(mcp_pids) >= 1  # the tools were hosted by processes the run started


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_worked_examples_show_tool_results_as_the_engine_renders_them(name, tokenizer):
    """A worked example in the prompt teaches the format the policy will read: each tool message of
    an example holds what `format_content` makes of that JSON."""
    import json

    from agentrl.engine.chat import ChatFormat
    from agentrl.engine.env import format_content
    from agentrl.engine.environments import make_env
    from agentrl.runconfig import load_run_config

    config = load_run_config(ROOT / "examples" / name / "config.toml").config
    env = make_env(ChatFormat(tokenizer), config.env)
    tool_messages = [content for role, content in env.example_messages() if role == "tool"]
    for content in tool_messages:
        body = content.removeprefix("<tool_response>\n").removesuffix("\n</tool_response>")
        assert body == format_content(json.loads(body)), body
