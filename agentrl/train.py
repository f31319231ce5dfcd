"""`agentrl train`: the whole job. A supervisor that starts the services, the actor (orchestrator)
and the learner as separate processes, drives the phases, evaluates, and writes the report.

    agentrl train [--config FILE] [--minutes M] [--out DIR] [--resume DIR]
                  [--vllm URL ...] [--tool-endpoint tcp://... ...]

Phases (the embedded default: configs/cpu_default.toml):
1. set-up: the synthetic world and its corpus, tool services (search, python, calculator; or the
   given endpoints), a vLLM server (or the given URLs). Not counted in the time budget; everything
   after it is (`minutes`).
2. held-out evaluation of the untrained policy with tools (Base Tool Call) and of Naive RAG.
3. SFT cold start (optional): gold trajectories of training questions are streamed to a learner
   process in `sft` mode; it pushes its weights to the servers when done; held-out evaluation.
4. asynchronous RL: a learner process (`rl` mode, initialised from the SFT checkpoint) and an actor
   process (the orchestrator: episodes through the servers and tools, GRPO groups streamed to the
   learner) run side by side; the learner pushes weights every step while rollouts continue. The
   supervisor evaluates on the held-out set every `eval.every_s`, restarts a learner that died
   (it resumes from its checkpoint and spool, so no group is lost or trained twice), and stops
   both early enough that the final evaluation still fits in the time budget.
5. final evaluation, `report.md` with plots, and one JSON line last.

Every process the supervisor starts is stopped by PID (SIGTERM, then SIGKILL of its process
group) at the end, on Ctrl-C, and when anything fails.

`--resume DIR` continues a stopped or killed run in DIR: finished phases are not repeated (their
results are read from `phases.json`), and the RL learner resumes from its latest checkpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import sys
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.common.config import deep_merge, dump_toml, from_dict, to_dict
from agentrl.common.files import read_jsonl
from agentrl.common.procs import ChildProcess
from agentrl.engine.env import EnvConfig
from agentrl.engine.episode import SamplingConfig
from agentrl.engine.orchestrator import OrchestratorConfig

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "cpu_default.toml"


# ---------------------------------------------------------------- configuration


@dataclass
class CurriculumStage:
    hops: list[int]
    """Hop counts of the training questions in this stage (drawn uniformly)."""
    until_version: int | None = None
    """Learner version (optimizer steps, SFT included) at which the next stage takes over; None: last stage."""


@dataclass
class DatasetFile:
    source: str
    """"hotpotqa", "2wikimultihopqa" or "musique" (the file's published format)."""
    path: str
    limit: int | None = None
    """Use the first `limit` questions of the file."""


@dataclass
class TasksConfig:
    source: str = "synthetic"
    """"synthetic" (generated world, the default) or "datasets" (train_files / eval_files / corpus)."""
    train_files: list[DatasetFile] = field(default_factory=list)
    eval_files: list[DatasetFile] = field(default_factory=list)
    corpus: str = ""
    """Passage JSONL ({"id","title","text"}) for the search service; required with datasets
    (e.g. a Wikipedia dump converted to JSONL); with synthetic tasks the world's corpus is used."""
    seed: int = 0
    """Seed of the synthetic world (entities, facts, corpus) and of question sampling."""
    num_companies: int = 400
    """World size; the held-out split is a fixed fraction of it."""
    heldout_num: int = 48
    """Held-out questions evaluated before, during and after training."""
    heldout_hops: list[int] = field(default_factory=lambda: [1, 2])
    num_train: int = 400
    """Distinct training questions drawn per curriculum stage (cycled)."""
    curriculum: list[CurriculumStage] = field(default_factory=lambda: [CurriculumStage([1], 6), CurriculumStage([1, 2])])


@dataclass
class ServicesConfig:
    vllm: list[str] = field(default_factory=list)
    """Existing vLLM servers (base URLs, started with `agentrl serve-model`); empty: start one."""
    tool_endpoints: list[str] = field(default_factory=list)
    """Existing tool services (ZeroMQ endpoints; replicas of one service are grouped by the tools they
    describe); empty: start `tools` here."""
    tools: list[str] = field(default_factory=lambda: ["search", "python", "calculator"])
    """Tool services to start when `tool_endpoints` is empty."""
    search_replicas: int = 1
    """Replicas of the search service to start."""
    vllm_dtype: str = "bfloat16"
    gpu_memory_utilization: float | None = None
    max_model_len: int = 4096
    max_learner_restarts: int = 3
    """A learner that dies is restarted (it resumes from its checkpoint) at most this many times."""


@dataclass
class SFTConfig:
    enabled: bool = True
    num_examples: int = 256
    """Gold trajectories generated from training questions (cycled until `steps` are done)."""
    hops: list[int] = field(default_factory=lambda: [1, 2])
    steps: int = 12
    """Optimizer steps of the cold start."""
    learner: dict = field(default_factory=dict)
    """LearnerConfig overrides for the SFT learner, on top of [learner] (e.g. a higher lr)."""


@dataclass
class EvalConfig:
    every_s: float = 300.0
    """Held-out evaluation interval during RL, seconds of wall-clock."""
    naive_rag: bool = True
    """Also evaluate the Naive RAG baseline once, before training."""
    in_budget: bool = True
    """Count the held-out evaluations against `minutes`. False: `minutes` is SFT + RL time only
    (the evaluations before, between and after extend the run): benchmarks/vs_trl.py compares
    training time with a trainer that evaluates outside its budget."""


@dataclass
class TrainConfig:
    minutes: float = 28.0
    """Wall-clock budget of everything after set-up (baseline evaluations, SFT, RL, every evaluation
    including the final one), minutes. The RL phase ends when what is left is the time the final
    evaluation is expected to take (`_final_eval_reserve_s`)."""
    seed: int = 0
    model_dir: str = ""
    """HF folder of the initial policy; empty: the prepared SmolLM2-135M-Instruct."""
    tasks: TasksConfig = field(default_factory=TasksConfig)
    services: ServicesConfig = field(default_factory=ServicesConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling of training episodes (evaluation is greedy)."""
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    learner: dict = field(default_factory=dict)
    """LearnerConfig fields (see agentrl.learner.service) for the RL learner; the supervisor fills
    in output_dir, mode, model_dir, endpoints and server_urls."""
    eval: EvalConfig = field(default_factory=EvalConfig)


def load_train_config(path: str | Path | None) -> TrainConfig:
    path = Path(path) if path else DEFAULT_CONFIG
    with open(path, "rb") as f:
        data = tomllib.load(f)
    config = from_dict(TrainConfig, data, str(path))
    validate_tasks_config(config.tasks)
    if config.sft.enabled and config.tasks.source != "synthetic":
        raise ValueError(f"{path}: the SFT cold start needs gold trajectories, which only synthetic tasks have; set [sft] enabled = false")
    return config


# ---------------------------------------------------------------- processes


def _agentrl(*args: str) -> list[str]:
    return [sys.executable, "-P", "-m", "agentrl.cli", *args]


def _free_endpoint() -> str:
    from agentrl.engine.serve import free_port

    return f"tcp://127.0.0.1:{free_port()}"


# ---------------------------------------------------------------- tasks


def _load_dataset_files(files: list[DatasetFile]) -> list:
    from agentrl.engine import tasks as T

    loaders = {"hotpotqa": T.load_hotpotqa, "2wikimultihopqa": T.load_2wikimultihopqa, "musique": T.load_musique}
    out = []
    for f in files:
        if f.source not in loaders:
            raise ValueError(f"dataset source {f.source!r} unknown; choose one of {sorted(loaders)}")
        tasks, _ = loaders[f.source](f.path, limit=f.limit)
        out += tasks
    return out


def validate_tasks_config(cfg: TasksConfig) -> None:
    if cfg.source not in ("synthetic", "datasets"):
        raise ValueError(f"[tasks] source must be 'synthetic' or 'datasets', got {cfg.source!r}")
    if cfg.source == "datasets":
        if not cfg.train_files or not cfg.eval_files:
            raise ValueError("[tasks] source = 'datasets' needs train_files and eval_files ([[tasks.train_files]] tables)")
        if not cfg.corpus:
            raise ValueError("[tasks] source = 'datasets' needs corpus = a passage JSONL for the search service")


def make_world(cfg: TasksConfig):
    from agentrl.engine.tasks import SyntheticQAConfig, SyntheticWorld

    return SyntheticWorld.generate(SyntheticQAConfig(seed=cfg.seed, num_companies=cfg.num_companies))


def curriculum_stream(world, cfg: TasksConfig, learner_version) -> Iterator:
    """Training questions forever; the stage follows the learner's version (`learner_version()`).
    With datasets there is one stage: the training files, cycled."""
    if cfg.source == "datasets":
        pool = _load_dataset_files(cfg.train_files)
        for i in itertools.count():
            yield pool[i % len(pool)]
    pools = [world.questions("train", hops=stage.hops, num=min(cfg.num_train, _pool_size(world, stage.hops)),
                             seed=cfg.seed + i) for i, stage in enumerate(cfg.curriculum)]
    cursors = [0] * len(pools)
    while True:
        version = learner_version()
        stage = next((i for i, s in enumerate(cfg.curriculum) if s.until_version is None or version < s.until_version),
                     len(cfg.curriculum) - 1)
        pool = pools[stage]
        yield pool[cursors[stage] % len(pool)]
        cursors[stage] += 1


def _pool_size(world, hops) -> int:
    return sum(len(world._question_pool("train", h)) for h in hops)


# ---------------------------------------------------------------- connections (supervisor and actor)


class Connections:
    """Clients of the running services and a ToolEnv over their tools."""

    def __init__(self, vllm_urls: list[str], tool_endpoints: dict[str, list[str]], model_dir: str, env_config: EnvConfig):
        self.vllm_urls, self.tool_endpoints, self.model_dir, self.env_config = vllm_urls, tool_endpoints, model_dir, env_config
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Connections:
        from transformers import AutoTokenizer

        from agentrl.engine.chat import ChatFormat
        from agentrl.engine.env import ToolEnv
        from agentrl.engine.pool import ServerPool
        from agentrl.engine.tools import remote_tools
        from agentrl.toolservers.client import ToolClient

        await self._stack.__aenter__()
        try:
            self.pool = await self._stack.enter_async_context(ServerPool(self.vllm_urls))
            self.chat = ChatFormat(AutoTokenizer.from_pretrained(self.model_dir))
            self.env = ToolEnv(self.chat, self.env_config)
            self.tools = []
            for endpoints in self.tool_endpoints.values():
                client = await self._stack.enter_async_context(ToolClient(endpoints))
                for tool in await remote_tools(client):
                    self.env.register_tool(tool)
                    self.tools.append(tool)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self._stack.aclose()


async def group_tool_endpoints(endpoints: list[str]) -> dict[str, list[str]]:
    """Group given endpoints into services by the tool names each describes (replicas agree)."""
    from agentrl.toolservers.client import ToolClient

    services: dict[str, list[str]] = {}
    for endpoint in endpoints:
        async with ToolClient([endpoint]) as client:
            names = sorted(spec["function"]["name"] for spec in await client.describe())
        services.setdefault(",".join(names), []).append(endpoint)
    return services


async def evaluate(conn: Connections, tasks: list, label: str) -> tuple[dict, list]:
    """Greedy held-out evaluation through the orchestrator; returns (summary, trajectories)."""
    from agentrl.engine.orchestrator import Orchestrator

    trajectories = []

    async def collect(group):
        trajectories.extend(group.trajectories)

    from agentrl.common.weights import reset_kv_cache

    versions_before = [await s.client.weight_version() for s in conn.pool.servers if s.alive]
    t0 = time.perf_counter()
    # Pushes may keep KV computed under earlier weights (learner `kv_refresh_every` > 1); an
    # evaluation starts from none. During RL the learner goes on pushing while it runs, so an RL-phase
    # evaluation is a mixture of versions (its summary records the version served at its start).
    await asyncio.gather(*(reset_kv_cache(url) for url in conn.pool.live_servers))
    orch = Orchestrator(conn.env, conn.pool.generate, collect,
                        OrchestratorConfig(group_size=1, max_concurrent_episodes=256, sampling=SamplingConfig(temperature=0.0)),
                        run_id=f"eval-{label}")
    await orch.run(tasks)
    n = len(trajectories)
    summary = {
        "label": label,
        "time": time.time(),
        "em": sum(t.metrics.get("em", 0.0) for t in trajectories) / max(n, 1),
        "f1": sum(t.metrics.get("f1", 0.0) for t in trajectories) / max(n, 1),
        "n": n,
        "num_failed": sum(t.status == "failed" for t in trajectories),
        "valid_call_rate": sum(t.metrics.get("process/valid_call", 0.0) > 0 for t in trajectories) / max(n, 1),
        "served_version": max(versions_before) if versions_before else -1,
        "eval_s": time.perf_counter() - t0,
    }
    for key, name in (("num_hops", "em_{}hop"), ("source", "em_{}")):
        values = sorted({getattr(t_, key) for t_ in tasks})
        if len(values) < 2:
            continue
        for value in values:
            ids = {t_.task_id for t_ in tasks if getattr(t_, key) == value}
            sel = [t for t in trajectories if t.task_id in ids]
            summary[name.format(value)] = sum(t.metrics.get("em", 0.0) for t in sel) / max(len(sel), 1)
    return summary, trajectories


# ---------------------------------------------------------------- the supervisor


class Supervisor:
    def __init__(self, config: TrainConfig, out: Path, *, resume: bool = False):
        self.config, self.out, self.resume = config, out, resume
        self.procs: list[ChildProcess] = []
        self.tool_procs: list = []
        self.vllm_server = None
        self.phases_path = out / "phases.json"
        self.phases: dict = json.loads(self.phases_path.read_text()) if resume and self.phases_path.exists() else {}
        self.learner_restarts = 0
        # Held-out evaluation summaries, oldest first: read once (on --resume), then appended by _log_eval.
        self.evals: list[dict] = read_jsonl(out / "evals.jsonl") if resume else []

    # -- bookkeeping
    def _phase_done(self, name: str, result: dict) -> None:
        self.phases[name] = result
        tmp = self.phases_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.phases, indent=1))
        os.replace(tmp, self.phases_path)

    def _log_eval(self, summary: dict, trajectories: list | None = None) -> None:
        self.deadline += eval_extends_deadline_s(summary, in_budget=self.config.eval.in_budget)
        self.evals.append(summary)
        with open(self.out / "evals.jsonl", "a") as f:
            f.write(json.dumps(summary) + "\n")
        if trajectories is not None:  # per question, so the report can pair two evaluations question by question
            folder = self.out / "evals"
            folder.mkdir(exist_ok=True)
            name = f"{summary['label']}-v{summary['served_version']}.jsonl"
            with open(folder / name, "w") as f:
                for t in sorted(trajectories, key=lambda t: t.task_id):
                    f.write(json.dumps({"task_id": t.task_id, "em": t.metrics.get("em", 0.0), "f1": t.metrics.get("f1", 0.0),
                                        "status": t.status}) + "\n")
        print(f"[eval {summary['label']}] EM {summary['em']:.3f}  F1 {summary['f1']:.3f}  n={summary['n']} "
              f"(served version {summary['served_version']}, {summary['eval_s']:.0f} s)", flush=True)

    # -- services
    async def start_services(self) -> None:
        from agentrl.common.model import resolve_model
        from agentrl.engine.serve import VLLMServer, VLLMServerConfig
        from agentrl.toolservers.process import start_toolserver

        cfg = self.config
        self.model_dir = str(resolve_model(cfg.model_dir or None))
        if cfg.tasks.source == "datasets":
            self.world = None
            self.corpus = Path(cfg.tasks.corpus)
            self.heldout = _load_dataset_files(cfg.tasks.eval_files)
        else:
            self.world = make_world(cfg.tasks)
            self.corpus = self.world.write_corpus(self.out / "corpus.jsonl")
            self.heldout = self.world.questions("heldout", hops=cfg.tasks.heldout_hops, num=cfg.tasks.heldout_num, seed=cfg.seed)
        logs = self.out / "logs"
        logs.mkdir(exist_ok=True)

        if cfg.services.tool_endpoints:
            self.tool_endpoints = await group_tool_endpoints(cfg.services.tool_endpoints)
        else:
            self.tool_endpoints = {}
            for name in cfg.services.tools:
                args = ["--corpus", str(self.corpus)] if name == "search" else []
                for r in range(cfg.services.search_replicas if name == "search" else 1):
                    proc = await asyncio.to_thread(start_toolserver, name, "tcp://127.0.0.1:*", *args,
                                                   log_path=str(logs / f"tool-{name}-{r}.log"))
                    self.tool_procs.append(proc)
                    self.tool_endpoints.setdefault(name, []).append(proc.endpoint)
                    print(f"tool service {name} #{r}: {proc.endpoint} (pid {proc.pid})", flush=True)
        if cfg.services.vllm:
            self.vllm_urls = list(cfg.services.vllm)
        else:
            self.vllm_server = VLLMServer(
                VLLMServerConfig(model_dir=self.model_dir, dtype=cfg.services.vllm_dtype, max_model_len=cfg.services.max_model_len,
                                 gpu_memory_utilization=cfg.services.gpu_memory_utilization),
                log_path=logs / "vllm.log",
            )
            print(f"starting vLLM server (log {self.vllm_server.log_path}) ...", flush=True)
            await asyncio.to_thread(self.vllm_server.start)
            print(f"vLLM server: {self.vllm_server.base_url} (pid {self.vllm_server.pid})", flush=True)
            self.vllm_urls = [self.vllm_server.base_url]

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(timeout_s=60)
        for proc in self.tool_procs:
            proc.stop(timeout_s=10)
        if self.vllm_server is not None:
            self.vllm_server.stop()

    # -- learner / actor processes
    def _learner_config(self, phase: str, overrides: dict) -> tuple[Path, dict]:
        base = deep_merge(self.config.learner, overrides)
        data = {
            **base,
            "output_dir": str(self.out / phase),
            "mode": "sft" if phase == "sft" else "rl",
            "model_dir": self.model_dir,
            "server_urls": self.vllm_urls,
            "group_endpoint": _free_endpoint(),
            "version_endpoint": _free_endpoint(),
            "progress_bar": False,
            "seed": self.config.seed,
        }
        path = self.out / f"learner-{phase}.toml"
        path.write_text(dump_toml(data))
        from agentrl.learner.service import load_config

        load_config(path)  # validate now, in the supervisor, with the learner's own rules
        return path, data

    def _start(self, name: str, argv: list[str]) -> ChildProcess:
        proc = ChildProcess(name, argv, log_path=self.out / "logs" / f"{name}.log").start()
        self.procs.append(proc)
        print(f"started {name} (pid {proc.pid}, log {proc.log_path})", flush=True)
        return proc

    # -- phases
    async def run(self) -> dict:
        cfg = self.config
        t0 = time.monotonic()
        await self.start_services()
        self.setup_s = time.monotonic() - t0
        self.deadline = time.monotonic() + cfg.minutes * 60
        async with Connections(self.vllm_urls, self.tool_endpoints, self.model_dir, cfg.env) as conn:
            self.conn = conn
            if "baseline" not in self.phases:
                summary, trajs = await evaluate(conn, self.heldout, "base_tool_call")
                self._log_eval(summary, trajs)
                _write_sample(self.out / "trajectories_base.jsonl", trajs[:8], conn.chat)
                result = {"base_tool_call": summary}
                if cfg.eval.naive_rag:
                    result["naive_rag"] = await self._naive_rag()
                self._phase_done("baseline", result)
            if not cfg.eval.in_budget:
                self.deadline = time.monotonic() + cfg.minutes * 60
            # On --resume the budget applies to what is left to do (a long run continues in slices).
            if cfg.sft.enabled and "sft" not in self.phases:
                await self._sft_phase()
            if "rl" not in self.phases:
                await self._rl_phase()
            summary, trajs = await evaluate(conn, self.heldout, "final")
            self._log_eval(summary, trajs)
            _write_sample(self.out / "trajectories_final.jsonl", trajs[:8], conn.chat)
            self._phase_done("final", summary)
        return self.phases

    async def _naive_rag(self) -> dict:
        from agentrl.engine.cli import RunConfig, run_naive_rag

        t0 = time.perf_counter()
        trajs = await run_naive_rag(self.conn.tools, self.conn.chat, self.conn.pool, self.heldout, RunConfig(env=self.config.env))
        n = len(trajs)
        summary = {"label": "naive_rag", "time": time.time(), "n": n, "eval_s": time.perf_counter() - t0, "served_version": 0,
                   "em": sum(t.metrics.get("em", 0.0) for t in trajs) / max(n, 1),
                   "f1": sum(t.metrics.get("f1", 0.0) for t in trajs) / max(n, 1)}
        self._log_eval(summary)
        return summary

    async def _sft_phase(self) -> None:
        from agentrl.common.trajectory import TrajectoryGroup
        from agentrl.common.transport import GroupSender
        from agentrl.engine.episode import build_gold_trajectory

        cfg = self.config
        tasks = self.world.questions("train", hops=cfg.sft.hops, num=cfg.sft.num_examples, seed=cfg.seed + 100)
        gold = [await build_gold_trajectory(self.conn.env, t, group_id=f"gold-{t.task_id}") for t in tasks]
        overrides = deep_merge(cfg.sft.learner, {"max_steps": cfg.sft.steps, "publish_every": cfg.sft.steps,
                                                 "checkpoint_every": cfg.sft.steps})
        config_path, data = self._learner_config("sft", overrides)
        learner = self._start("learner-sft", _agentrl("learner", "--config", str(config_path)))
        sender = GroupSender(data["group_endpoint"], max_unacked=8)
        await sender.start()
        t0 = time.perf_counter()
        epoch = 0
        try:
            while learner.poll() is None:
                for i, traj in enumerate(gold):
                    if learner.poll() is not None:
                        break
                    gid = f"sft-{epoch}-{i}"
                    group = TrajectoryGroup(gid, traj.task_id, [dataclasses.replace(traj, group_id=gid)])
                    send = asyncio.ensure_future(sender.send(group))
                    while not send.done():
                        await asyncio.wait([send], timeout=1.0)
                        if learner.poll() is not None:
                            send.cancel()
                            break
                epoch += 1
        finally:
            await sender.close(timeout_s=2.0)
        rc = learner.poll()
        if rc != 0:
            raise RuntimeError(f"SFT learner exited with {rc}; log {learner.log_path}:\n{learner.log_tail()}")
        summary, trajs = await evaluate(self.conn, self.heldout, "sft")
        self._log_eval(summary, trajs)
        self._phase_done("sft", {**summary, "sft_s": time.perf_counter() - t0, "steps": cfg.sft.steps, "epochs_streamed": epoch})

    async def _rl_phase(self) -> None:
        cfg = self.config
        overrides = {"max_steps": int(self.config.learner.get("max_steps", 100000))}
        sft_ckpt = self.out / "sft" / "checkpoints"
        if cfg.sft.enabled:
            overrides["init_checkpoint"] = str(sft_ckpt)
        config_path, data = self._learner_config("rl", overrides)
        actor_cfg = {
            "vllm": self.vllm_urls,
            "tool_endpoints": self.tool_endpoints,
            "model_dir": self.model_dir,
            "group_endpoint": data["group_endpoint"],
            "version_endpoint": data["version_endpoint"],
            "out_dir": str(self.out / "actor"),
            "tasks": to_dict(cfg.tasks),
            "env": to_dict(cfg.env),
            "orchestrator": {**to_dict(cfg.orchestrator), "sampling": to_dict(cfg.sampling)},
        }
        actor_path = self.out / "actor.toml"
        actor_path.write_text(dump_toml(actor_cfg))
        learner = self._start("learner-rl", _agentrl("learner", "--config", str(config_path)))
        actor = self._start("actor", _agentrl("actor", "--config", str(actor_path)))
        next_eval = time.monotonic() + cfg.eval.every_s
        try:
            def rl_end() -> float:  # an evaluation outside the budget moves the deadline
                return self.deadline - self._final_eval_reserve_s()

            print(f"RL phase: {max(rl_end() - time.monotonic(), 0) / 60:.1f} minutes", flush=True)
            while time.monotonic() < rl_end():
                await asyncio.sleep(2.0)
                if actor.poll() is not None:
                    raise RuntimeError(f"actor exited with {actor.poll()}; log {actor.log_path}:\n{actor.log_tail()}")
                rc = learner.poll()
                if rc is not None:
                    if rc == 0:
                        print("learner finished its max_steps", flush=True)
                        break
                    if self.learner_restarts >= cfg.services.max_learner_restarts:
                        raise RuntimeError(f"learner died {self.learner_restarts + 1} times; log {learner.log_path}:\n{learner.log_tail()}")
                    self.learner_restarts += 1
                    print(f"learner exited with {rc}; restarting it (restart {self.learner_restarts}), it resumes from its checkpoint",
                          flush=True)
                    self.procs.remove(learner)
                    learner = self._start("learner-rl", _agentrl("learner", "--config", str(config_path)))
                if rl_eval_fits(time.monotonic(), self.evals, next_eval_s=next_eval, rl_end_s=rl_end(),
                                in_budget=cfg.eval.in_budget):
                    summary, trajs = await evaluate(self.conn, self.heldout, "rl")
                    self._log_eval(summary, trajs)
                    next_eval = time.monotonic() + cfg.eval.every_s
        finally:
            # In threads: the event loop must keep answering the tool services' heartbeats.
            await asyncio.to_thread(actor.stop, 30)
            await asyncio.to_thread(learner.stop, 120)
        self._phase_done("rl", {"learner_restarts": self.learner_restarts, "learner_rc": learner.poll(), "actor_rc": actor.poll()})


    def _final_eval_reserve_s(self) -> float:
        return final_eval_reserve_s(self.evals, in_budget=self.config.eval.in_budget)


# ---------------------------------------------------------------- the time-budget rules
# `minutes` covers everything after set-up. Three rules keep a run inside it; they are functions of
# the evaluation summaries so that they can be tested without starting a run.


def eval_extends_deadline_s(summary: dict, *, in_budget: bool) -> float:
    """Seconds an evaluation adds to the deadline. With evaluations outside the budget the
    before/after evaluations (sft, final) are added back; an RL-phase evaluation is not, because
    training goes on beside it. The baseline evaluations run before the budget starts."""
    if in_budget or summary["label"] not in ("sft", "final"):
        return 0.0
    return float(summary["eval_s"])


def final_eval_reserve_s(evals: list[dict], *, in_budget: bool) -> float:
    """Time the RL phase leaves before the deadline: stopping the RL processes (the learner
    checkpoints on SIGTERM: ~10 s) and the final evaluation, i.e. 1.25 x the latest evaluation that
    had the server to itself (after SFT, else the baseline; RL-phase evaluations share the server
    with the actor and run slower; Naive RAG generates one turn only), plus 30 s; 120 s stand in for
    an evaluation when none ran yet. 0 when evaluations are outside the budget."""
    if not in_budget:
        return 0.0
    durations = [e["eval_s"] for e in evals if e.get("label") not in ("naive_rag", "rl") and "eval_s" in e]
    return 1.25 * (durations[-1] if durations else 120.0) + 30.0


def rl_eval_fits(now_s: float, evals: list[dict], *, next_eval_s: float, rl_end_s: float, in_budget: bool) -> bool:
    """Whether to start an RL-phase evaluation now: it is due, and 1.25 x the last RL-phase one
    still ends before the RL phase does. Before the first, the final-evaluation reserve stands in
    for it (an RL-phase evaluation runs beside the actor and the learner, so longer than a clean one)."""
    rl_durations = [e["eval_s"] for e in evals if e.get("label") == "rl" and "eval_s" in e]
    expected_s = rl_durations[-1] if rl_durations else final_eval_reserve_s(evals, in_budget=in_budget)
    return now_s >= next_eval_s and now_s + 1.25 * expected_s < rl_end_s


def _write_sample(path: Path, trajectories, chat) -> None:
    with open(path, "w") as f:
        for t in trajectories:
            f.write(json.dumps({"task_id": t.task_id, "status": t.status, "task_reward": t.task_reward, "metrics": t.metrics,
                                "text": chat.decode(t.token_ids.tolist())}) + "\n")


# ---------------------------------------------------------------- the actor process


@dataclass
class ActorConfig:
    vllm: list[str]
    tool_endpoints: dict
    """service name -> replica endpoints."""
    model_dir: str
    group_endpoint: str
    version_endpoint: str
    out_dir: str
    tasks: TasksConfig = field(default_factory=TasksConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)


async def run_actor(cfg: ActorConfig) -> int:
    from agentrl.common.transport import GroupSender, VersionSubscriber
    from agentrl.engine.orchestrator import Orchestrator

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    world = make_world(cfg.tasks) if cfg.tasks.source == "synthetic" else None
    async with Connections(cfg.vllm, cfg.tool_endpoints, cfg.model_dir, cfg.env) as conn:
        # The learner's queue is part of the staleness budget: every group waiting there is trained
        # at a later version than the one that sampled it. Bounding the unacknowledged groups to
        # the orchestrator's own in-flight bound keeps data at most ~2 x that many steps old.
        sender = GroupSender(cfg.group_endpoint, max_unacked=cfg.orchestrator.max_groups_in_flight)
        versions = VersionSubscriber(cfg.version_endpoint)
        await sender.start()
        await versions.start()
        try:
            stream = curriculum_stream(world, cfg.tasks, lambda: (versions.latest or (0, 0))[0])
            orch = Orchestrator(conn.env, conn.pool.generate, sender.send, cfg.orchestrator, versions=versions,
                                run_id=f"rl{int(time.time())}-{os.getpid()}")
            run = asyncio.ensure_future(orch.run(stream))
            stats_path = out / "stats.jsonl"
            t0 = time.time()
            while not run.done() and not stop.is_set():
                await asyncio.wait([run], timeout=10.0)
                with open(stats_path, "a") as f:
                    f.write(json.dumps({"time": time.time(), "elapsed_s": time.time() - t0, **dataclasses.asdict(orch.stats),
                                        "generated_tokens": conn.pool.num_generated_tokens,
                                        "latest_version": versions.latest}) + "\n")
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
        finally:
            await versions.close()
            await sender.close(timeout_s=5.0)
    return 0


def actor_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl actor", description="The actor process: the orchestrator of a training run.")
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    with open(args.config, "rb") as f:
        cfg = from_dict(ActorConfig, tomllib.load(f), args.config)
    return asyncio.run(run_actor(cfg))


# ---------------------------------------------------------------- entry point


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help=f"TOML config (default: {DEFAULT_CONFIG.name}, the CPU default)")
    parser.add_argument("--minutes", type=float, default=None, help="wall-clock budget of everything after set-up (SFT, RL and, unless eval.in_budget = false, the evaluations), minutes")
    parser.add_argument("--out", default=None, help="run directory (default: runs/<timestamp>)")
    parser.add_argument("--resume", default=None, help="continue the run in this directory")
    parser.add_argument("--vllm", action="append", default=[], help="use this vLLM server (repeatable) instead of starting one")
    parser.add_argument("--tool-endpoint", action="append", default=[], help="use this tool service (repeatable)")
    args = parser.parse_args(argv)

    if args.resume:
        out = Path(args.resume)
        if not (out / "config.toml").is_file():
            print(f"agentrl train: {out} holds no run (no config.toml)", file=sys.stderr)
            return 2
        config = load_train_config(out / "config.toml")
    else:
        try:
            config = load_train_config(args.config)
        except (ValueError, OSError, tomllib.TOMLDecodeError) as err:
            print(f"agentrl train: bad config: {err}", file=sys.stderr)
            return 2
        out = Path(args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
        if (out / "config.toml").exists():
            # A second run would append to the first one's evals.jsonl and metrics, and its report
            # would mix the two.
            print(f"agentrl train: {out} already holds a run; continue it with --resume {out}, or choose another --out",
                  file=sys.stderr)
            return 2
        out.mkdir(parents=True, exist_ok=True)
    if args.minutes is not None:
        config.minutes = args.minutes
    if args.vllm:
        config.services.vllm = args.vllm
    if args.tool_endpoint:
        config.services.tool_endpoints = args.tool_endpoint
    (out / "config.toml").write_text(dump_toml(dataclasses.asdict(config)))

    try:
        supervisor = Supervisor(config, out, resume=bool(args.resume))
    except ValueError as err:
        print(f"agentrl train: cannot resume: {err}", file=sys.stderr)
        return 2
    t0 = time.time()
    stop = {"sig": None}

    def on_signal(signum, _frame):
        stop["sig"] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        phases = asyncio.run(supervisor.run())
    except KeyboardInterrupt:
        print("interrupted: stopping every process this run started", file=sys.stderr)
        supervisor.stop_all()
        return 130
    finally:
        supervisor.stop_all()
    from agentrl.report import write_report

    report = write_report(out)
    base = phases["baseline"]["base_tool_call"]
    final = phases["final"]
    rl_metrics = _last_metrics(out / "rl" / "metrics.jsonl")
    summary = {
        "em_before": round(base["em"], 4),
        "em_sft": round(phases["sft"]["em"], 4) if "sft" in phases else None,
        "em_after": round(final["em"], 4),
        "f1_before": round(base["f1"], 4),
        "f1_after": round(final["f1"], 4),
        "em_naive_rag": round(phases["baseline"]["naive_rag"]["em"], 4) if "naive_rag" in phases["baseline"] else None,
        "episodes": _actor_episodes(out / "actor" / "stats.jsonl"),
        "optimizer_steps": rl_metrics.get("step", 0),
        "learner_restarts": phases.get("rl", {}).get("learner_restarts", 0),
        "minutes": round((time.time() - t0) / 60, 2),
        "minutes_after_setup": round((time.time() - t0 - supervisor.setup_s) / 60, 2),
        "report": str(report),
        "out": str(out),
    }
    if "sft" in phases:
        from agentrl.report import eval_records, paired_comparison

        paired = paired_comparison(eval_records(out, "sft", phases["sft"]), eval_records(out, "final", phases["final"]))
        if paired:
            summary |= {"rl_vs_sft_gained": paired["gained"], "rl_vs_sft_lost": paired["lost"],
                        "rl_vs_sft_p_value": round(paired["p_value"], 4)}
    print(json.dumps(summary))
    return 0


def _last_metrics(path: Path) -> dict:
    if not path.exists():
        return {}
    lines = path.read_text().splitlines()
    return json.loads(lines[-1]) if lines else {}


def _actor_episodes(path: Path) -> int:
    """Episodes finished by the actor (summed over actor restarts)."""
    if not path.exists():
        return 0
    total, last = 0, None
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if last is not None and rec["num_episodes_finished"] < last:
            total += last
        last = rec["num_episodes_finished"]
    return total + (last or 0)
