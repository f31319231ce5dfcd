"""Call latency of MCP tools (engine/mcp.py) over stdio and streamable HTTP, one call in flight.

    python benchmarks/mcp.py            # about half a minute here

Each path makes `WARMUP` calls, then `RUNS` runs of `CALLS` sequential calls through
`Tool.execute` (what the ToolEnv calls), and reports per run the median and p90 latency; the
figures are the median over runs of those, with the min-max spread of the run medians.

- stdio: tests/fixtures/mcp/tiny_server.py (the SDK's MCPServer) as a child process, tool `add`;
  and the PyPI `mcp-server-time` (`get_current_time`).
- http: the same tiny server with the streamable-HTTP transport on a loopback port, tool `add`.
- zmq (baseline, same run): the project's calculator tool service through `RemoteTool`.

Client and servers share the machine's 2 cores. The last line is one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "tests" / "fixtures" / "mcp" / "tiny_server.py"
MCP_SERVER_TIME = Path(sys.executable).parent / "mcp-server-time"
WARMUP = 20
CALLS = 200
RUNS = 3


async def measure(tool, arguments: dict) -> dict:
    for _ in range(WARMUP):
        await _checked(tool, arguments)
    medians_ms, p90s_ms = [], []
    for _ in range(RUNS):
        latencies_ms = []
        for _ in range(CALLS):
            start = time.perf_counter()
            await _checked(tool, arguments)
            latencies_ms.append(1000 * (time.perf_counter() - start))
        medians_ms.append(statistics.median(latencies_ms))
        p90s_ms.append(statistics.quantiles(latencies_ms, n=10)[-1])
    return {"p50_ms": round(statistics.median(medians_ms), 3), "p90_ms": round(statistics.median(p90s_ms), 3),
            "p50_ms_min": round(min(medians_ms), 3), "p50_ms_max": round(max(medians_ms), 3)}


async def _checked(tool, arguments: dict):
    result = await tool.execute(arguments, timeout_s=10)
    if not result.success:
        raise AssertionError(f"{tool.name}: {result.error}")
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_http_server(port: int, log_path: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-P", str(TINY), "--http", str(port)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=open(log_path, "ab"), start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the HTTP MCP server exited with {proc.returncode}; see {log_path}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


async def run(log_dir: str) -> dict:
    from agentrl.engine.mcp import McpServer, McpServerConfig
    from agentrl.engine.tools import remote_tools
    from agentrl.toolservers.client import ToolClient
    from agentrl.toolservers.process import start_toolserver

    out: dict = {}
    add = {"a": 2, "b": 40}
    stdio = McpServerConfig(command=sys.executable, args=("-P", str(TINY)), name="tiny",
                            stderr_log_path=f"{log_dir}/tiny.log")
    async with McpServer(stdio) as server:
        out["stdio"] = await measure(next(t for t in server.tools if t.name == "add"), add)
    time_cfg = McpServerConfig(command=str(MCP_SERVER_TIME), args=("--local-timezone", "UTC"),
                               stderr_log_path=f"{log_dir}/time.log")
    async with McpServer(time_cfg) as server:
        tool = next(t for t in server.tools if t.name == "get_current_time")
        out["stdio_mcp_server_time"] = await measure(tool, {"timezone": "Europe/Paris"})

    port = free_port()
    http_proc = start_http_server(port, f"{log_dir}/http.log")
    try:
        async with McpServer(McpServerConfig(url=f"http://127.0.0.1:{port}/mcp")) as server:
            out["http"] = await measure(next(t for t in server.tools if t.name == "add"), add)
    finally:
        stop_group(http_proc)

    calculator = start_toolserver("calculator", "tcp://127.0.0.1:*", log_path=f"{log_dir}/calculator.log")
    try:
        async with ToolClient([calculator.endpoint]) as client:
            tool = next(t for t in await remote_tools(client) if t.name == "calculator")
            out["zmq_baseline"] = await measure(tool, {"expression": "2+40"})
    finally:
        calculator.stop(10)
    return out


def main() -> None:
    from importlib.metadata import version

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    facts = {"cpu_count": os.cpu_count(), "python_version": platform.python_version(), "mcp_version": version("mcp"),
             "git_commit": commit.stdout.strip(), "load_avg_1m_at_start": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory(prefix="bench-mcp-") as log_dir:
        results = asyncio.run(run(log_dir))
    flat = {f"{path}_{key}": value for path, figures in results.items() for key, value in figures.items()}
    for path, figures in results.items():
        print(f"{path:24s} p50 {figures['p50_ms']:7.3f} ms  p90 {figures['p90_ms']:7.3f} ms  "
              f"(run medians {figures['p50_ms_min']}-{figures['p50_ms_max']})")
    print(json.dumps({**flat, "calls_per_run": CALLS, "runs": RUNS, "warmup_calls": WARMUP, **facts,
                      "load_avg_1m_at_end": round(os.getloadavg()[0], 2)}), flush=True)


if __name__ == "__main__":
    from agentrl.common.procs import exit_on_sigterm

    exit_on_sigterm()
    main()
