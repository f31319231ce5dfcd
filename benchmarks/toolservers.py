"""Tool services over ZeroMQ vs. the same tools behind a plain aiohttp HTTP JSON server.

    python benchmarks/toolservers.py            # the default run (about 2-3 minutes here)

For each tool (calculator, search, python) and each number of requests in flight (1, 16, 64,
1024), a closed-loop load generator keeps that many calls outstanding for `RUN_S` seconds, `RUNS`
times after a warm-up, and reports requests/s and p50/p99 latency (medians over runs, with the
min-max spread of requests/s). Each tool is served by ONE server process:

- zmq:  `agentrl toolserver NAME` (ROUTER, batched msgpack frames), driven by `ToolClient`.
- http: BASELINE, not a product path: the same Tool objects (same code, same sandbox pool) behind
  an aiohttp server taking one JSON POST per call, the way SandboxFusion-style services are
  called; driven by an aiohttp client session with one keep-alive connection per call in flight.

The search corpus is an embedded synthetic one (20,000 passages, seeded). Calculator expressions
and search queries vary per call so that nothing is answered from a cache. The python snippet is
trivial (`print(i * i)`): its cost is the sandbox round trip. The load generator runs in this
process on the same 2 cores as the server, so every figure includes the client's cost.

The last line printed is one JSON object with flat keys, e.g. calculator_rps_64,
calculator_rps_64_http, search_rps_64, python_p50_ms_16, python_p99_ms_16, plus machine facts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IN_FLIGHT = {"calculator": (1, 64, 1024), "search": (1, 64, 1024), "python": (1, 16, 64, 1024)}
RUNS = 3
RUN_S = 1.5
WARMUP_S = 0.5
NUM_PASSAGES = 20_000
PYTHON_WORKERS = 4


# --- workload ------------------------------------------------------------------------------------

WORDS = ("river harbor castle bridge market forest valley mountain island garden library temple "
         "tower station museum school factory mill farm lake").split()


def make_corpus(path: Path, num_passages: int) -> None:
    rng = random.Random(0)
    syllables = ["ka", "lo", "mer", "dan", "vi", "tor", "bel", "sun", "rak", "mo", "zen", "pil", "dor"]
    with open(path, "w") as f:
        for i in range(num_passages):
            name = "".join(rng.choice(syllables) for _ in range(3)).capitalize()
            text = " ".join(rng.choice(WORDS) for _ in range(40))
            f.write(json.dumps({"id": f"d{i}", "title": name, "text": f"{name} {text} record {i}"}) + "\n")


def make_args(tool: str, i: int) -> dict:
    if tool == "calculator":
        return {"expression": f"({i} + 7) * 3 / 5 - 2 ** 3"}
    if tool == "search":
        rng = random.Random(i)
        return {"query": " ".join(rng.sample(WORDS, 3)) + f" record {i % NUM_PASSAGES}", "top_k": 3}
    return {"code": f"print({i} * {i})"}


def check(tool: str, i: int, content) -> None:
    """Every answer is checked, cheaply (the checker shares the 2 cores with the server)."""
    if tool == "calculator":
        numerator = (i + 7) * 3 - 40  # (i + 7) * 3 / 5 - 8 == ((i + 7) * 3 - 40) / 5
        g = math.gcd(numerator, 5)
        good = content["value"] == (f"{numerator // g}" if g == 5 else f"{numerator // g}/{5 // g}")
    elif tool == "search":
        good = len(content) == 3
    else:
        good = content["stdout"] == f"{i * i}\n"
    if not good:
        raise AssertionError(f"{tool} call {i} answered wrongly: {content!r}")


# --- HTTP baseline server ------------------------------------------------------------------------


def serve_http(tool_name: str, port: int, corpus: str | None, cache_dir: str | None) -> None:
    """BASELINE: the project's Tool objects behind aiohttp, one JSON POST per call."""
    from aiohttp import web

    from agentrl.toolservers.server import Job

    if tool_name == "calculator":
        from agentrl.toolservers.calculator import CalculatorTool

        tool = CalculatorTool()
    elif tool_name == "search":
        from agentrl.toolservers.search import SearchConfig, SearchTool

        tool = SearchTool(SearchConfig(corpus_path=corpus, cache_dir=cache_dir))
    else:
        from agentrl.toolservers.sandbox import PythonTool, SandboxConfig

        tool = PythonTool(SandboxConfig(num_workers=PYTHON_WORKERS))
    tool.start()
    waiting: dict[int, asyncio.Future] = {}
    ids = iter(range(1 << 62))

    def finish(done) -> None:
        for job, outcome in done:
            fut = waiting.pop(job.req_id)
            if not fut.done():
                fut.set_result(outcome)

    async def handle(request: web.Request) -> web.Response:
        body = await request.json()
        now = time.monotonic()
        job = Job(b"", next(ids), body["args"], now, now + 30.0)
        waiting[job.req_id] = asyncio.get_running_loop().create_future()
        fut = waiting[job.req_id]
        finish(tool.submit([job]))
        outcome = await fut
        if outcome.ok:
            return web.json_response({"ok": True, "content": outcome.content})
        return web.json_response({"ok": False, "error": outcome.error.__dict__})

    async def pump_pool() -> None:
        loop = asyncio.get_running_loop()
        watched: set[int] = set()
        while True:  # the pool's fds change only when a sandbox restarts
            current = set(tool.fds())
            for fd in watched - current:
                loop.remove_reader(fd)
            for fd in current - watched:
                loop.add_reader(fd, lambda fd=fd: finish(tool.on_readable(fd)))
            watched = current
            finish(tool.tick(time.monotonic()))
            await asyncio.sleep(0.05)

    async def main() -> None:
        app = web.Application(client_max_size=1 << 20)
        app.router.add_post("/call", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
        pump = asyncio.create_task(pump_pool())
        print(f"READY http://127.0.0.1:{port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (15, 2):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        pump.cancel()
        await runner.cleanup()
        tool.close(2.0)

    asyncio.run(main())


def start_http(tool: str, corpus: str, cache_dir: str):
    import tempfile

    from agentrl.toolservers.process import ToolServerProcess

    argv = [sys.executable, __file__, "--serve-http", tool, "--port", str(free_port()), "--corpus", corpus,
            "--cache-dir", cache_dir]
    log_path = tempfile.mkstemp(prefix=f"agentrl-http-baseline-{tool}-", suffix=".log")[1]
    proc = ToolServerProcess(f"http-{tool}", argv, log_path=log_path).start()
    proc.endpoint = proc.wait_for_line("READY ", 120.0).split(" ", 1)[1]
    return proc


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- load generation -----------------------------------------------------------------------------


async def closed_loop(call, tool: str, in_flight: int, duration_s: float, first_i: int) -> dict:
    """Keep `in_flight` calls outstanding for duration_s; returns rps and latency quantiles."""
    latencies_s: list[float] = []
    counter = iter(range(first_i, first_i + 10**9))
    end = time.perf_counter() + duration_s

    async def worker() -> None:
        while time.perf_counter() < end:
            i = next(counter)
            t0 = time.perf_counter()
            content = await call(make_args(tool, i))
            latencies_s.append(time.perf_counter() - t0)
            check(tool, i, content)

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(in_flight)])
    elapsed_s = time.perf_counter() - t0
    latencies_s.sort()
    return {
        "rps": len(latencies_s) / elapsed_s,
        "p50_ms": 1e3 * latencies_s[len(latencies_s) // 2],
        "p99_ms": 1e3 * latencies_s[min(len(latencies_s) - 1, int(len(latencies_s) * 0.99))],
        "num_calls": len(latencies_s),
    }


async def measure(call, tool: str, in_flight: int) -> dict:
    await closed_loop(call, tool, in_flight, WARMUP_S, 0)
    runs = [await closed_loop(call, tool, in_flight, RUN_S, (k + 1) * 10**7) for k in range(RUNS)]
    rps = [r["rps"] for r in runs]
    return {
        "rps": statistics.median(rps),
        "rps_min": min(rps),
        "rps_max": max(rps),
        "p50_ms": statistics.median(r["p50_ms"] for r in runs),
        "p99_ms": statistics.median(r["p99_ms"] for r in runs),
    }


async def bench_zmq(tool: str, endpoint: str) -> dict[int, dict]:
    from agentrl.toolservers.client import ToolClient

    async with ToolClient([endpoint], request_timeout_s=60.0) as client:
        async def call(args: dict):
            resp = await client.call(tool, args)
            if not resp.ok:
                raise AssertionError(f"{tool}: {resp.error}")
            return resp.content

        return {n: await measure(call, tool, n) for n in IN_FLIGHT[tool]}


async def bench_http(tool: str, url: str) -> dict[int, dict]:
    import aiohttp

    results = {}
    for n in IN_FLIGHT[tool]:
        connector = aiohttp.TCPConnector(limit=n, force_close=False)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
            async def call(args: dict, session=session):
                async with session.post(f"{url}/call", json={"tool": tool, "args": args}) as r:
                    body = await r.json()
                if not body["ok"]:
                    raise AssertionError(f"{tool} over HTTP: {body['error']}")
                return body["content"]

            results[n] = await measure(call, tool, n)
    return results


def machine() -> dict:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {
        "cpu_count": os.cpu_count(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "git_commit": commit.stdout.strip(),
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
    }


def main(tools: tuple[str, ...] = ("calculator", "search", "python")) -> None:
    from agentrl.toolservers.process import start_toolserver

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # 1024 HTTP connections need the fds
    facts = machine()
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-tools-") as tmp:
        corpus = str(Path(tmp) / "corpus.jsonl")
        cache = str(Path(tmp) / "cache")
        make_corpus(Path(corpus), NUM_PASSAGES)
        for tool in tools:
            extra = {"calculator": [], "search": ["--corpus", corpus, "--cache-dir", cache],
                     "python": ["--workers", str(PYTHON_WORKERS)]}[tool]
            server = start_toolserver(tool, "tcp://127.0.0.1:*", *extra)
            try:
                zmq_results = asyncio.run(bench_zmq(tool, server.endpoint))
            finally:
                server.stop(15)
            http = start_http(tool, corpus, cache)
            try:
                http_results = asyncio.run(bench_http(tool, http.endpoint))
            finally:
                http.stop(15)
            for n in IN_FLIGHT[tool]:
                z, h = zmq_results[n], http_results[n]
                print(f"{tool:10s} in_flight={n:5d}  zmq {z['rps']:8.0f} req/s ({z['rps_min']:.0f}-{z['rps_max']:.0f}) "
                      f"p50 {z['p50_ms']:7.2f} ms p99 {z['p99_ms']:8.2f} ms | http {h['rps']:8.0f} req/s "
                      f"p50 {h['p50_ms']:7.2f} ms p99 {h['p99_ms']:8.2f} ms | x{z['rps'] / h['rps']:.2f}", flush=True)
                for key in ("rps", "rps_min", "rps_max", "p50_ms", "p99_ms"):
                    out[f"{tool}_{key}_{n}"] = round(z[key], 2)
                    out[f"{tool}_{key}_{n}_http"] = round(h[key], 2)
                out[f"{tool}_zmq_over_http_rps_{n}"] = round(z["rps"] / h["rps"], 2)
    if "calculator" in tools:
        out.update(target_calculator_rps_64=15000, calculator_target_met=out["calculator_rps_64"] >= 15000)
    if "python" in tools:
        out.update(target_python_p50_ms_16=50.0, python_target_met=out["python_p50_ms_16"] <= 50.0)
    out.update(
        runs=RUNS, run_s=RUN_S, num_passages=NUM_PASSAGES, python_workers=PYTHON_WORKERS,
        load_avg_1m_at_end=round(os.getloadavg()[0], 2), **facts,
    )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    from agentrl.common.procs import exit_on_sigterm

    exit_on_sigterm()
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve-http", choices=("calculator", "search", "python"))
    ap.add_argument("--port", type=int)
    ap.add_argument("--corpus")
    ap.add_argument("--cache-dir")
    ap.add_argument("--tools", nargs="+", choices=("calculator", "search", "python"),
                    default=("calculator", "search", "python"), help="a subset, for quick checks")
    a = ap.parse_args()
    if a.serve_http:
        serve_http(a.serve_http, a.port, a.corpus, a.cache_dir)
    else:
        main(tuple(a.tools))
