"""docs/ENVIRONMENTS.md runs: its code blocks are written to the files they name (their first-line
comment) and used exactly as shown: the tool service starts from the config's command and answers,
the environment plays its demonstration through that real tool, the tasks load, and the config
resolves (every plug-in imports, every option validates)."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "ENVIRONMENTS.md"


def _blocks() -> dict[str, str]:
    out = {}
    for lang, body in re.findall(r"```(python|toml)\n(.*?)```", DOC.read_text(), re.S):
        first = body.splitlines()[0]
        match = re.match(r"# (\S+\.(?:py|toml))", first)
        assert match, f"a {lang} block of {DOC.name} does not start with its file name: {first!r}"
        out[match.group(1)] = body
    return out


@pytest.fixture()
def doc_folder(tmp_path, monkeypatch):
    blocks = _blocks()
    assert set(blocks) == {"my_tools.py", "my_env.py", "make_tasks.py", "my_config.toml", "my_config_with_calculator.toml"}
    for name, body in blocks.items():
        (tmp_path / name).write_text(body)
    monkeypatch.chdir(tmp_path)
    subprocess.run([sys.executable, "make_tasks.py"], check=True, cwd=tmp_path, timeout=60)
    return tmp_path


def test_the_documented_config_resolves_and_its_plugins_work(doc_folder, tokenizer):
    from agentrl.engine.chat import ChatFormat
    from agentrl.engine.environments import make_env
    from agentrl.engine.episode import build_demonstration
    from agentrl.engine.services import Connections, start_services
    from agentrl.engine.tasksets import load_taskset
    from agentrl.runconfig import load_run_config

    config = load_run_config("my_config.toml").config
    # Relative paths in a config file are taken from the file's folder.
    assert config.env.env_class == f"{doc_folder.resolve()}/my_env.py:WordCountEnv" and config.tasks.loader == "jsonl"
    assert config.tasks.options["heldout"] == str(doc_folder.resolve() / "heldout.jsonl")
    assert config.tools[0].cwd == str(doc_folder.resolve())
    taskset = load_taskset(config.tasks, doc_folder / "run")
    assert len(taskset.heldout) == 40 and taskset.heldout[0].task_id == "heldout-0"

    # No vLLM server here: the demonstration is scripted, so a URL that is never called stands in.
    no_server = dataclasses.replace(config.services, vllm=["http://127.0.0.1:9"])

    async def run():
        services = await start_services(no_server, tools=config.tools, env_required=(), model_dir="",
                                        corpus=None, logs=doc_folder / "logs")
        try:
            async with Connections(services.vllm_urls, services.remote, str(tokenizer.name_or_path), config.env) as conn:
                assert set(conn.env.tools) == {"word_count"}
                traj = await build_demonstration(conn.env, taskset.heldout[3])
                return traj, services.procs
        finally:
            services.stop()

    traj, procs = asyncio.run(run())
    assert traj.status == "ok" and traj.task_reward == 1.0 and traj.metrics["correct"] == 1.0
    assert traj.metrics["process/tool_success"] > 0  # the hosted word_count answered
    assert all(p.poll() is not None for p in procs), "the tool service outlived the run"
    env = make_env(ChatFormat(tokenizer), config.env)
    assert "word_count tool" in env.system_prompt


def test_the_documented_function_also_runs_in_process(doc_folder):
    from agentrl.engine.services import FunctionSource, function_tool

    tool = function_tool(FunctionSource(function="my_tools.py:word_count"), "tools[0]")
    assert tool.parameters["required"] == ["text"] and tool.description == "Count the words of a text."
    assert asyncio.run(tool.execute({"text": "one two three"})).content == {"words": 3}


def test_the_documented_combination_hosts_the_calculator_beside_the_own_service(doc_folder, tokenizer):
    from agentrl.engine.environments import env_class
    from agentrl.engine.services import Connections, start_services
    from agentrl.runconfig import load_run_config

    config = load_run_config("my_config_with_calculator.toml").config
    no_server = dataclasses.replace(config.services, vllm=["http://127.0.0.1:9"])

    async def run():
        services = await start_services(no_server, tools=config.tools, env_required=env_class(config.env).required_tools,
                                        model_dir="", corpus=None, logs=doc_folder / "logs")
        try:
            async with Connections(services.vllm_urls, services.remote, str(tokenizer.name_or_path), config.env) as conn:
                return set(conn.env.tools), services.procs
        finally:
            services.stop()

    tools, procs = asyncio.run(run())
    assert tools == {"word_count", "calculator"} and len(procs) == 2
    assert all(p.poll() is not None for p in procs)
