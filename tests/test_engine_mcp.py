"""MCP servers as tools (engine/mcp.py), against real servers: the tiny MCPServer in
tests/fixtures/mcp/tiny_server.py (stdio and streamable HTTP, started as subprocesses) and the
PyPI `mcp-server-time`. Processes are checked and stopped by PID."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import pytest_asyncio

from agentrl.engine.mcp import E_DEADLINE, E_TOOL, E_UNAVAILABLE, McpServer, McpServerConfig, McpStartError
from agentrl.engine.tools import FunctionTool, ToolUnavailable

# The module's servers live on the session loop (engine/mcp.py binds an McpServer to the loop it started on).
session_loop = pytest.mark.asyncio(loop_scope="session")

TINY = Path(__file__).parent / "fixtures" / "mcp" / "tiny_server.py"
TINY_TOOLS = {"add", "echo", "total", "fail", "error_result", "sleep", "pid", "spawn_child"}
MCP_SERVER_TIME = Path(sys.executable).parent / "mcp-server-time"


def tiny_config(**fields) -> McpServerConfig:
    return McpServerConfig(command=sys.executable, args=("-P", str(TINY)), name="tiny", **fields)


def alive(pid: int) -> bool:
    """Running (a zombie is dead: it holds nothing and only waits to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


async def until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module", autouse=True)
def temp_dir(tmp_path_factory):
    """The servers' default stderr logs (and the CLI's temporary ones) go under pytest's tmp, not /tmp."""
    path = tmp_path_factory.mktemp("mcp-tmp")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tempfile, "tempdir", str(path))
        patch.setenv("TMPDIR", str(path))
        yield path


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def tiny(temp_dir):
    server = McpServer(tiny_config())
    await server.start()
    yield server
    await server.close()


# -- stdio ---------------------------------------------------------------------------------------


@session_loop
async def test_describe_gives_the_servers_names_descriptions_and_input_schemas(tiny):
    tools = {t.name: t for t in tiny.tools}
    assert set(tools) == TINY_TOOLS
    add = tools["add"]
    assert add.description == "Add two integers."
    assert add.parameters["type"] == "object" and add.parameters["required"] == ["a", "b"]
    assert add.parameters["properties"]["a"]["type"] == "integer"
    assert tools["total"].parameters["properties"]["terms"] == {"items": {"type": "integer"}, "title": "Terms", "type": "array"}
    assert add.schema() == {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                                             "parameters": add.parameters}}


@session_loop
async def test_a_call_returns_the_content(tiny):
    add = next(t for t in tiny.tools if t.name == "add")
    result = await add.execute({"a": 2, "b": 40}, timeout_s=10)
    assert result.success and result.error is None and result.content == {"result": 42}
    assert 0 < result.latency_s < 10
    total = await tiny.call("total", {"terms": [1, 2, 3]}, timeout_s=10)
    assert total.content == {"total": 6, "terms": [1, 2, 3]}  # structuredContent, kept as JSON
    assert (await tiny.call("echo", {"text": "a\nb \u2603"}, timeout_s=10)).content == {"result": "a\nb \u2603"}


@session_loop
@pytest.mark.parametrize("tool, arguments, fragment", [
    ("fail", {"message": "the index is missing"}, "the index is missing"),       # the tool raises ToolError
    ("error_result", {"message": "quota exceeded"}, "quota exceeded"),           # the tool returns isError
    ("add", {"a": "x", "b": 1}, "valid integer"),                                # the server rejects the arguments
    ("no_such_tool", {}, "Unknown tool"),
])
async def test_a_failing_tool_gives_a_failed_result_with_its_message(tiny, tool, arguments, fragment):
    result = await tiny.call(tool, arguments, timeout_s=10)
    assert not result.success and result.content is None
    assert fragment in result.error and result.error_type == E_TOOL


@session_loop
async def test_a_call_past_its_deadline_times_out_and_the_session_stays_usable(tiny):
    pid = tiny.pid
    start = time.perf_counter()
    result = await tiny.call("sleep", {"seconds": 31}, timeout_s=0.3)
    assert not result.success and result.error == "timed out after 0.3 s" and result.error_type == E_DEADLINE
    assert time.perf_counter() - start < 2.0

    async def cancelled_on_the_server():
        return "sleep 31.0 cancelled" in Path(tiny.log_path).read_text()

    await until(cancelled_on_the_server, 10, "the server sees the request cancelled")
    again = await tiny.call("add", {"a": 1, "b": 1}, timeout_s=10)
    assert again.success and again.content == {"result": 2}
    assert tiny.pid == pid and tiny.num_restarts == 0  # the same process and session


@session_loop
async def test_concurrent_calls_share_one_session(tiny):
    results = await asyncio.gather(*(tiny.call("add", {"a": i, "b": i}, timeout_s=10) for i in range(50)))
    assert [r.content["result"] for r in results] == [2 * i for i in range(50)]


@session_loop
async def test_a_killed_server_fails_calls_as_tool_errors_then_is_restarted(caplog):
    server = McpServer(tiny_config(restart_initial_delay_s=0.2))
    caplog.set_level(logging.INFO, logger="agentrl.engine.mcp")
    await server.start()
    try:
        old_pid = server.pid
        in_flight = asyncio.create_task(server.call("sleep", {"seconds": 30}, timeout_s=20))
        await asyncio.sleep(0.3)
        os.kill(old_pid, signal.SIGKILL)
        lost = await in_flight
        assert not lost.success and lost.error_type == E_UNAVAILABLE and "went away during the call" in lost.error
        down = await server.call("add", {"a": 1, "b": 2}, timeout_s=5)  # not ToolUnavailable: a tool error
        assert not down.success and down.error_type == E_UNAVAILABLE and "is down" in down.error

        async def answered():
            result = await server.call("add", {"a": 1, "b": 2}, timeout_s=5)
            return result if result.success else None

        back = await until(answered, 30, "the restarted server answers")
        assert back.content == {"result": 3}
        assert server.num_restarts == 1 and server.pid != old_pid and not alive(old_pid)
        assert (await server.call("pid", {}, timeout_s=5)).content == {"result": server.pid}
        logged = [r.getMessage() for r in caplog.records]
        assert any("lost after" in m and f"pid {old_pid} exit status -9" in m and "restart 1 in 0.2 s" in m for m in logged)
        assert any(f"restarted (restart 1, pid {server.pid})" in m for m in logged)
    finally:
        await server.close()


@session_loop
async def test_close_leaves_no_process_behind_and_later_calls_raise_tool_unavailable():
    server = McpServer(tiny_config())
    await server.start()
    leader = server.pid
    grandchild = (await server.call("spawn_child", {}, timeout_s=10)).content["result"]
    assert alive(leader) and alive(grandchild)
    assert os.getpgid(grandchild) == leader  # the server's own process group
    start = time.perf_counter()
    await server.close()
    assert time.perf_counter() - start < server.config.close_timeout_s
    assert not alive(leader) and not alive(grandchild)
    assert server.pid is None
    with pytest.raises(ToolUnavailable, match="closed"):
        await server.call("add", {"a": 1, "b": 2})
    await server.close()  # idempotent


@session_loop
async def test_close_escalates_to_sigkill_when_the_group_ignores_sigterm():
    # An ignored signal stays ignored across exec, so the server and the child it spawns both ignore SIGTERM.
    wrapper = ("import os, signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               f"os.execv(sys.executable, [sys.executable, '-P', {str(TINY)!r}])")
    server = McpServer(McpServerConfig(command=sys.executable, args=("-P", "-c", wrapper), name="stubborn",
                                       sigterm_grace_s=0.5))
    await server.start()
    grandchild = (await server.call("spawn_child", {}, timeout_s=10)).content["result"]
    start = time.perf_counter()
    await server.close()
    assert time.perf_counter() - start >= 0.5  # SIGTERM was waited out before SIGKILL
    assert not alive(grandchild)


@session_loop
async def test_crash_loop_restarts_back_off_exponentially_and_reset_after_a_healthy_period(tmp_path, caplog):
    """The wrapper runs the server while `ok` exists and exits 1 otherwise: a crash loop on demand."""
    ok = tmp_path / "ok"
    ok.touch()
    wrapper = f"import os, sys; os.path.exists({str(ok)!r}) or sys.exit(1); os.execv(sys.executable, [sys.executable, '-P', {str(TINY)!r}])"
    server = McpServer(McpServerConfig(command=sys.executable, args=("-P", "-c", wrapper), name="flaky",
                                       restart_initial_delay_s=0.1, restart_max_delay_s=0.4, healthy_reset_s=3.0))
    caplog.set_level(logging.WARNING, logger="agentrl.engine.mcp")
    await server.start()
    try:
        ok.unlink()
        os.kill(server.pid, signal.SIGKILL)
        await until(lambda: asyncio.sleep(0, server.num_restarts >= 5), 60, "five restarts")
        ok.touch()

        async def answered():
            return (await server.call("add", {"a": 1, "b": 1}, timeout_s=5)).success

        await until(answered, 60, "the server is back")
        delays = [float(r.getMessage().rsplit(" in ", 1)[1].rstrip(" s")) for r in caplog.records if "restart" in r.getMessage()]
        assert delays[:5] == [0.1, 0.2, 0.4, 0.4, 0.4]  # doubling, capped
        num_before = server.num_restarts
        await asyncio.sleep(server.config.healthy_reset_s + 0.5)  # healthy long enough: the delay resets
        caplog.clear()
        os.kill(server.pid, signal.SIGKILL)
        await until(answered, 60, "the server is back after the second loss")
        assert server.num_restarts == num_before + 1
        assert [r.getMessage().endswith("in 0.1 s") for r in caplog.records if "restart" in r.getMessage()][:1] == [True]
    finally:
        await server.close()


@session_loop
@pytest.mark.parametrize("command, args, fragment", [
    ("/nonexistent/mcp-server", (), "No such file"),
    (sys.executable, ("-c", "import sys; sys.stderr.write('bad configuration: no API key\\n'); sys.exit(3)"),
     "bad configuration: no API key"),
])
async def test_a_server_that_cannot_start_raises_with_its_stderr(command, args, fragment):
    server = McpServer(McpServerConfig(command=command, args=args, start_timeout_s=20))
    with pytest.raises(McpStartError, match=fragment):
        await server.start()
    assert server.pid is None


@session_loop
async def test_real_mcp_server_time_over_stdio():
    config = McpServerConfig(command=str(MCP_SERVER_TIME), args=("--local-timezone", "UTC"))
    async with McpServer(config) as server:
        tools = {t.name: t for t in server.tools}
        assert set(tools) == {"get_current_time", "convert_time"}
        assert set(tools["convert_time"].parameters["required"]) == {"source_timezone", "time", "target_timezone"}
        assert tools["get_current_time"].idempotent  # from its idempotentHint annotation
        converted = await tools["convert_time"].execute(
            {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"}, timeout_s=10)
        assert converted.success and converted.content["time_difference"] == "+9.0h"
        assert converted.content["target"]["datetime"].endswith("T21:00:00+09:00")
        now = await tools["get_current_time"].execute({"timezone": "Europe/Paris"}, timeout_s=10)
        assert now.success and now.content["timezone"] == "Europe/Paris"
        bad = await tools["get_current_time"].execute({"timezone": "Mars/Olympus_Mons"}, timeout_s=10)
        assert not bad.success and "Invalid timezone" in bad.error
        pid = server.pid
    assert not alive(pid)


# -- streamable HTTP -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HttpTinyServer:
    """tiny_server.py --http PORT as a subprocess in its own process group."""

    def __init__(self, port: int, log_path: Path):
        self.port, self.url, self.log_path = port, f"http://127.0.0.1:{port}/mcp", log_path
        self.popen = subprocess.Popen([sys.executable, "-P", str(TINY), "--http", str(port)], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=open(log_path, "ab"), start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"the HTTP MCP server exited with {self.popen.returncode}: {log_path.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)


@pytest.fixture(scope="module")
def http_tiny(tmp_path_factory):
    server = HttpTinyServer(free_port(), tmp_path_factory.mktemp("mcp-http") / "server.log")
    yield server
    server.stop()


@session_loop
async def test_streamable_http_lists_and_calls_and_fails_like_stdio(http_tiny):
    async with McpServer(McpServerConfig(url=http_tiny.url)) as server:
        assert {t.name for t in server.tools} == TINY_TOOLS
        assert (await server.call("add", {"a": 20, "b": 22}, timeout_s=10)).content == {"result": 42}
        failed = await server.call("fail", {"message": "nope"}, timeout_s=10)
        assert not failed.success and "nope" in failed.error and failed.error_type == E_TOOL
        slow = await server.call("sleep", {"seconds": 32}, timeout_s=0.3)
        assert slow.error == "timed out after 0.3 s"

        async def cancelled_on_the_server():
            return "sleep 32.0 cancelled" in http_tiny.log_path.read_text()

        await until(cancelled_on_the_server, 10, "the HTTP server sees the request cancelled")
        assert (await server.call("add", {"a": 1, "b": 1}, timeout_s=10)).content == {"result": 2}
        assert server.pid is None  # the HTTP server's process is not ours


@session_loop
async def test_streamable_http_session_is_reopened_after_the_server_restarts(tmp_path):
    port = free_port()
    http = HttpTinyServer(port, tmp_path / "server.log")
    server = McpServer(McpServerConfig(url=http.url, restart_initial_delay_s=0.2, restart_max_delay_s=1.0))
    try:
        await server.start()
        first_pid = (await server.call("pid", {}, timeout_s=10)).content["result"]
        http.stop(signal.SIGKILL)
        down = await server.call("add", {"a": 1, "b": 2}, timeout_s=5)
        assert not down.success and down.error_type == E_UNAVAILABLE
        http = HttpTinyServer(port, tmp_path / "server.log")

        async def answered():
            result = await server.call("pid", {}, timeout_s=5)
            return result if result.success else None

        back = await until(answered, 60, "the new HTTP server answers")
        assert back.content["result"] != first_pid and server.num_restarts >= 1
    finally:
        await server.close()
        http.stop()


# -- the CLI -------------------------------------------------------------------------------------


def agentrl(*args: str, timeout_s: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "agentrl.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s)


TINY_COMMAND = f"{sys.executable} -P {TINY}"


def test_cli_describe_and_call_an_mcp_server_over_stdio(tmp_path, temp_dir):
    described = agentrl("tool", "describe", "--mcp", TINY_COMMAND)
    assert described.returncode == 0, described.stderr
    specs = {s["function"]["name"]: s for s in json.loads(described.stdout)}
    assert specs["add"]["type"] == "function" and specs["add"]["function"]["parameters"]["required"] == ["a", "b"]
    assert specs["add"]["idempotent"] is False

    log_path = tmp_path / "tiny.log"
    ok = agentrl("tool", "call", "--mcp", TINY_COMMAND, "--mcp-log", str(log_path), "--tool", "add",
                 "--args", '{"a": 2, "b": 3}')
    assert ok.returncode == 0 and json.loads(ok.stdout) == {"ok": True, "content": {"result": 5}}, ok.stderr
    assert log_path.exists()
    failed = agentrl("tool", "call", "--mcp", TINY_COMMAND, "--tool", "fail", "--args", '{"message": "no"}')
    assert failed.returncode == 0  # the server answered
    assert json.loads(failed.stdout)["error"] == {"type": "tool_error", "message": "Error executing tool fail: no"}
    assert not list(temp_dir.glob("agentrl-mcp-*.log"))  # the temporary logs of answered calls are removed


def test_cli_exit_codes_for_unreachable_servers_and_bad_usage():
    crashing = agentrl("tool", "describe", "--mcp", f"{sys.executable} -c 'import sys; sys.exit(\"no API key\")'")
    assert crashing.returncode == 1 and "could not start MCP server" in crashing.stderr
    assert "no API key" in crashing.stderr and "exited with status 1" in crashing.stderr  # the kept log's tail
    unreachable = agentrl("tool", "describe", "--mcp", "/nonexistent/mcp-server")
    assert unreachable.returncode == 1 and "No such file" in unreachable.stderr
    refused = agentrl("tool", "describe", "--mcp-url", f"http://127.0.0.1:{free_port()}/mcp", "--timeout-s", "10")
    assert refused.returncode == 1 and "could not start MCP server" in refused.stderr
    assert agentrl("tool", "call", "--mcp", TINY_COMMAND, "--tool", "add", "--args", "{not json").returncode == 2
    assert agentrl("tool", "call", "--mcp", TINY_COMMAND, "--tool", "add", "--args", "[1]").returncode == 2
    assert agentrl("tool", "describe", "--mcp", "").returncode == 2
    assert agentrl("tool", "describe", "--mcp", TINY_COMMAND, "--endpoint", "tcp://127.0.0.1:9").returncode == 2


def test_cli_over_streamable_http(http_tiny):
    called = agentrl("tool", "call", "--mcp-url", http_tiny.url, "--tool", "total", "--args", '{"terms": [4, 5]}')
    assert called.returncode == 0, called.stderr
    assert json.loads(called.stdout) == {"ok": True, "content": {"total": 9, "terms": [4, 5]}}


# -- through the ToolEnv -------------------------------------------------------------------------


@session_loop
async def test_an_episode_through_toolenv_cannot_tell_an_mcp_tool_from_a_local_one(tiny):
    from transformers import AutoTokenizer

    from agentrl.common.model import prepare_model
    from agentrl.engine import rewards as R
    from agentrl.engine.chat import ChatFormat
    from agentrl.engine.env import EnvConfig
    from agentrl.engine.episode import SamplingConfig, ScriptedPolicy, run_episode
    from agentrl.envs.multihop_qa.env import MultiHopQAEnv
    from agentrl.envs.multihop_qa.tasks import qa_task

    chat = ChatFormat(AutoTokenizer.from_pretrained(prepare_model()))
    mcp_add = next(t for t in tiny.tools if t.name == "add")
    local_add = FunctionTool("add", mcp_add.description, mcp_add.parameters, lambda a, b: {"result": a + b})
    task = qa_task("t0", "What is 2 + 40?", ("42",))
    actions = [
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": "two", "b": 40}}</tool_call>',  # the env checks the MCP schema
        "<answer>42</answer>",
    ]

    async def episode(tool):
        env = MultiHopQAEnv(chat, EnvConfig(max_turns=4, worked_example=False, tool_timeout_s=10))
        env.register_tool(tool)
        return await run_episode(env, task, ScriptedPolicy(env, list(actions)), SamplingConfig(), group_id="g")

    via_mcp, via_local = await episode(mcp_add), await episode(local_add)
    assert via_mcp.status == "ok" and via_mcp.task_reward == 1.0
    text = chat.decode(via_mcp.token_ids.tolist())
    assert '<tool_response>\n{"result": 42}\n</tool_response>' in text
    assert "invalid arguments at a" in text
    assert R.TOOL_SUCCESS in via_mcp.turns[0].process_rewards and R.MALFORMED_CALL in via_mcp.turns[1].process_rewards
    assert via_mcp.token_ids.tolist() == via_local.token_ids.tolist()  # token for token the same episode
    assert via_mcp.is_action.tolist() == via_local.is_action.tolist()
    assert [t.process_rewards for t in via_mcp.turns] == [t.process_rewards for t in via_local.turns]
