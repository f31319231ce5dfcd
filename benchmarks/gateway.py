"""Gateway benchmark: chat turns/s and CPU per turn of the gateway process, beside the native orchestrator.

    python benchmarks/gateway.py            # 1,024 concurrent sessions x 4 turns; 3 measured runs after a warm-up
    python benchmarks/gateway.py --quick    # 256 sessions, 1 measured run

Both sides talk to the same STAND-IN token server (benchmarks/standin_token_server.py: it answers
every token-in/token-out request at once with a pre-tokenized search call), so what is measured is
the work of the process in front of it, per turn:

- gateway: `agentrl gateway --vllm STANDIN` in its own process. This process is the agent side:
  1,024 concurrent sessions (one keep-alive connection each, `X-Agentrl-Session` header), each 4
  chat turns as an OpenAI agent sends them: the whole history every turn (system prompt, the
  engine's worked example as chat messages, the question, then each answer echoed back with its
  `tool_calls` and answered by a tool message holding three corpus passages), `tools` = the search
  schema; then `DELETE /agentrl/sessions/{id}` (the final record, as a trainer collects it). The
  agent side is a minimal HTTP/1.1 client on asyncio streams with msgspec, so that it costs less per
  turn than the gateway and does not hold the gateway back.
- native: benchmarks/rollout.py's capacity part with 256 prompts x 4 samples = 1,024 concurrent
  episodes of 4 turns (the engine's ToolEnv, instant search over the same passages).

The gateway process is pinned to the last core (on a machine with two or more) and the agent side
and the stand-in to the others, so that it has one core and nothing else runs on it; the native side
runs unpinned, as benchmarks/rollout.py runs it.

Reported per side: wall-clock turns/s, CPU us per turn of the measured process (/proc for the
gateway, process time for the in-process orchestrator) and turns per CPU second; for the gateway
also the stand-in's and the agent side's CPU per turn. Medians of the measured runs (spread =
max - min). Target: the gateway process >= 2,000 turns per CPU second (one core). One JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parent.parent


def _rollout_benchmark():
    """benchmarks/rollout.py as a module (benchmarks/ is not a package): its capacity part, machine
    record and helpers."""
    spec = importlib.util.spec_from_file_location("rollout_benchmark", REPO / "benchmarks" / "rollout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rollout = _rollout_benchmark()


class Connection:
    """One keep-alive HTTP/1.1 connection; one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host_header: str):
        self.reader, self.writer, self.host_header = reader, writer, host_header

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer, f"{host}:{port}")

    async def request(self, method: str, path: str, headers: str, body: bytes = b"") -> tuple[int, bytes]:
        self.writer.write(f"{method} {path} HTTP/1.1\r\nHost: {self.host_header}\r\n{headers}"
                          f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


class _Answer(msgspec.Struct):
    choices: list[dict]


def agent_messages(question: str) -> list[dict]:
    from agentrl.envs.multihop_qa.env import EXAMPLE_MESSAGES

    system = ("You answer questions by searching a knowledge base. Look up one fact per search. "
              "When you know the answer, reply <answer>short answer</answer>.")
    example = [{"role": role, "content": content} if role != "tool" else
               {"role": "tool", "tool_call_id": "example",  # the gateway adds the <tool_response> tags itself
                "content": content.removeprefix("<tool_response>\n").removesuffix("\n</tool_response>")}
               for role, content in EXAMPLE_MESSAGES]
    return [{"role": "system", "content": system}, *example,
            {"role": "user", "content": f"Question: {question}"}]


async def run_sessions(host: str, port: int, model: str, questions: list[str], passages: list[dict], tools: list[dict],
                       num_turns: int, run: int, connections: list[Connection]) -> tuple[int, int]:
    """Every session's conversation, all concurrently; returns (turns, tool calls answered)."""
    from agentrl.engine.env import format_content

    encoder, decoder = msgspec.json.Encoder(), msgspec.json.Decoder(_Answer)
    num_calls = 0

    async def session(k: int) -> None:
        nonlocal num_calls
        conn = connections[k]
        session_id = f"bench-{run}-{k}"
        headers = f"X-Agentrl-Session: {session_id}\r\n"
        messages = agent_messages(questions[k % len(questions)])
        for _ in range(num_turns):
            body = encoder.encode({"model": model, "messages": messages, "tools": tools, "temperature": 1.0})
            status, data = await conn.request("POST", "/v1/chat/completions", headers, body)
            if status != 200:
                raise RuntimeError(f"session {session_id}: HTTP {status}: {data[:300]!r}")
            message = decoder.decode(data).choices[0]["message"]
            messages.append(message)
            for call in message.get("tool_calls") or ():
                query = json.loads(call["function"]["arguments"])["query"]
                start = hash(query) % (len(passages) - 3)
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": format_content(passages[start:start + 3])})
                num_calls += 1
        status, data = await conn.request("DELETE", f"/agentrl/sessions/{session_id}", "")
        if status != 200:
            raise RuntimeError(f"closing session {session_id}: HTTP {status}: {data[:300]!r}")

    await asyncio.gather(*(session(k) for k in range(len(connections))))
    return len(connections) * num_turns, num_calls


async def gateway_side(model_dir: str, standin_url: str, standin_pid: int, num_sessions: int, num_turns: int, num_runs: int,
                       gateway_cpu: int | None) -> dict:
    from agentrl.engine.tools import SEARCH_PARAMETERS
    from agentrl.envs.multihop_qa.tasks import SyntheticQAConfig, synthetic_tasks

    world, tasks = synthetic_tasks(split="train", num=256, config=SyntheticQAConfig(num_companies=400))
    tools = [{"type": "function", "function": {"name": "search", "description": "Search the knowledge base.", "parameters": SEARCH_PARAMETERS}}]
    gateway = subprocess.Popen([sys.executable, "-P", "-m", "agentrl.cli", "gateway", "--port", "0", "--vllm", standin_url,
                                "--model", model_dir, "--max-model-len", "4096", "--max-sessions", str(2 * num_sessions)],
                               stdout=subprocess.PIPE, start_new_session=True)
    if gateway_cpu is not None:
        os.sched_setaffinity(gateway.pid, {gateway_cpu})
    try:
        line = gateway.stdout.readline().decode().strip()
        if not line.startswith("http://"):
            raise RuntimeError(f"the gateway did not start (said {line!r})")
        host, port = line.removeprefix("http://").rsplit(":", 1)
        connections = [await Connection.open(host, int(port)) for _ in range(num_sessions)]
        model = Path(model_dir).name
        rates, cpu_us, standin_us, agent_us = [], [], [], []
        for run in range(num_runs + 1):  # run 0: the warm-up (memos, connection pools, first-time code paths)
            gw0, si0, me0, wall0 = rollout.process_cpu_s(gateway.pid), rollout.process_cpu_s(standin_pid), time.process_time(), time.perf_counter()
            num, num_calls = await run_sessions(host, int(port), model, [t.prompt for t in tasks], world.passages, tools,
                                                num_turns, run, connections)
            wall = time.perf_counter() - wall0
            gw, si, me = rollout.process_cpu_s(gateway.pid) - gw0, rollout.process_cpu_s(standin_pid) - si0, time.process_time() - me0
            if num_calls != num:
                raise RuntimeError(f"{num - num_calls} of {num} turns came back without a tool call")
            if run:
                rates.append(num / wall)
                cpu_us.append(gw / num * 1e6)
                standin_us.append(si / num * 1e6)
                agent_us.append(me / num * 1e6)
                print(f"gateway run {run}: {num} turns in {wall:.2f} s = {rates[-1]:.0f} turns/s; gateway {cpu_us[-1]:.0f} CPU us/turn, "
                      f"stand-in {standin_us[-1]:.0f}, agent side {agent_us[-1]:.0f}; load average {os.getloadavg()[0]:.1f}",
                      file=sys.stderr)
        for conn in connections:
            conn.close()
        stats = json.loads((await _get(host, int(port), "/agentrl/stats")).decode())
        if stats["num_render_drifts"] or stats["num_prefix_breaks"] or stats["num_sessions_open"]:
            raise RuntimeError(f"the benchmark's sessions should be one segment each, without drift, all closed: {stats}")
    finally:
        os.killpg(gateway.pid, signal.SIGTERM)
        gateway.wait(30)
    return {"gateway_turns_per_s": round(statistics.median(rates), 1), "gateway_turns_per_s_spread": round(rollout.spread(rates), 1),
            "gateway_cpu_us_per_turn": round(statistics.median(cpu_us), 1), "gateway_cpu_us_per_turn_spread": round(rollout.spread(cpu_us), 1),
            "gateway_turns_per_cpu_s": round(1e6 / statistics.median(cpu_us), 1),
            "gateway_standin_cpu_us_per_turn": round(statistics.median(standin_us), 1),
            "gateway_agent_side_cpu_us_per_turn": round(statistics.median(agent_us), 1),
            "gateway_concurrent_sessions": num_sessions, "gateway_turns_per_session": num_turns,
            "gateway_requests_per_session": num_turns + 1, "gateway_exit_code": gateway.returncode}


async def _get(host: str, port: int, path: str) -> bytes:
    conn = await Connection.open(host, port)
    try:
        status, data = await conn.request("GET", path, "")
    finally:
        conn.close()
    if status != 200:
        raise RuntimeError(f"GET {path}: HTTP {status}")
    return data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="256 sessions / episodes, one measured run")
    parser.add_argument("--skip-native", action="store_true", help="the gateway side only")
    args = parser.parse_args()
    num_sessions, num_runs, num_turns = (256, 1, 4) if args.quick else (1024, 3, 4)

    from agentrl.common.model import prepare_model

    model_dir = str(prepare_model())
    result: dict = {"benchmark": "gateway", **rollout.machine(), "load_average_1m_start": round(os.getloadavg()[0], 2)}
    start = time.perf_counter()
    # The gateway gets a core of its own ("on one core"); the agent side and the stand-in share the rest.
    cores = sorted(os.sched_getaffinity(0))
    gateway_cpu = cores[-1] if len(cores) >= 2 else None
    if gateway_cpu is not None:
        os.sched_setaffinity(0, set(cores[:-1]))
    result["gateway_pinned_cpu"] = gateway_cpu
    port = rollout.free_port()
    standin = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "standin_token_server.py"), "--port", str(port),
                                "--tokenizer", model_dir], stdout=subprocess.PIPE, start_new_session=True)
    try:
        line = standin.stdout.readline().decode()
        if not line.startswith("READY"):
            raise RuntimeError(f"stand-in token server did not start (said {line!r})")
        result.update(asyncio.run(gateway_side(model_dir, f"http://127.0.0.1:{port}", standin.pid, num_sessions, num_turns, num_runs,
                                                gateway_cpu)))
    finally:
        os.killpg(standin.pid, signal.SIGTERM)
        standin.wait(10)
        os.sched_setaffinity(0, set(cores))  # the native side runs as benchmarks/rollout.py runs it: unpinned
    if not args.skip_native:
        # The native side starts its own stand-in (rollout.capacity owns it); same size: 1,024 episodes of 4 turns.
        native = asyncio.run(rollout.capacity(model_dir, num_prompts=num_sessions // 4, group_size=4, num_runs=num_runs))
        result.update({f"native_{k}": v for k, v in native.items()})
        result["gateway_vs_native_cpu_per_turn"] = round(result["gateway_cpu_us_per_turn"] / native["cpu_us_per_turn"], 2)
    result.update(benchmark_wall_s=round(time.perf_counter() - start, 1), load_average_1m_end=round(os.getloadavg()[0], 2),
                  target_gateway_turns_per_cpu_s=2000)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    from agentrl.cli import exit_on_sigterm

    exit_on_sigterm()
    sys.exit(main())
