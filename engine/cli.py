"""`agentrl eval` and `agentrl rollout`: the orchestrator without a learner.

    agentrl eval [--config FILE.toml] [--limit N] [--temperature T] [--servers URL,...] [--no-baselines]
    agentrl rollout --config FILE.toml --out FILE.jsonl [--limit N]

With no config, eval runs the embedded default: held-out synthetic multi-hop questions (seed 0,
1-4 hops), the prepared SmolLM2-135M-Instruct on a real vLLM server and a real search tool server
over the synthetic corpus, both started here and stopped (by PID) on exit. It reports, for the policy
with tools (= Base Tool Call when the policy is the untrained model) and the Naive RAG baseline
(one retrieval with the question, then the answer), EM and F1; the last line is one JSON object.

Config (TOML; every section and key optional, unknown keys are an error):
    [tasks]        source = "synthetic" | "hotpotqa" | "2wikimultihopqa" | "musique"; path; corpus;
                   split; num; hops; seed; num_companies
    [inference]    servers = [base URLs] (empty: start one); model_dir; max_model_len
    [tools]        search_endpoints = [ZeroMQ endpoints] (empty: start one over the corpus)
    [env]          EnvConfig fields (max_turns, max_action_tokens, ...)
    [sampling]     temperature, top_p, seed
    [orchestrator] group_size, max_concurrent_episodes, max_groups_in_flight
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.common.config import from_dict
from agentrl.engine.env import EnvConfig
from agentrl.engine.episode import SamplingConfig
from agentrl.engine.orchestrator import OrchestratorConfig
from agentrl.engine.tasks import QATask

log = logging.getLogger(__name__)


@dataclass
class TasksConfig:
    source: str = "synthetic"
    """"synthetic", "hotpotqa", "2wikimultihopqa" or "musique"."""
    path: str = ""
    """Dataset file in its published format (not for synthetic)."""
    corpus: str = ""
    """Passage JSONL for the search service; empty: the synthetic corpus, or the dataset's own contexts."""
    split: str = "heldout"
    """Synthetic split: "train" or "heldout"."""
    num: int = 64
    """Questions to evaluate (the first `num` of the file for datasets)."""
    hops: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    seed: int = 0
    """Synthetic world seed."""
    num_companies: int = 400
    """Synthetic world size (see SyntheticQAConfig)."""


@dataclass
class InferenceConfig:
    servers: list[str] = field(default_factory=list)
    """vLLM base URLs; empty: start one (and stop it on exit)."""
    model_dir: str = ""
    """HF folder of the policy (tokenizer too); empty: the prepared SmolLM2-135M-Instruct."""
    max_model_len: int = 4096
    """For a server started here, tokens."""


@dataclass
class ToolsConfig:
    search_endpoints: list[str] = field(default_factory=list)
    """Search service replicas; empty: start one over the corpus (and stop it on exit)."""
    request_timeout_s: float = 30.0


@dataclass
class RunConfig:
    tasks: TasksConfig = field(default_factory=TasksConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0))
    orchestrator: OrchestratorConfig = field(default_factory=lambda: OrchestratorConfig(group_size=1))


def load_config(path: str | None) -> RunConfig:
    if path is None:
        return RunConfig()
    return from_dict(RunConfig, tomllib.loads(Path(path).read_text()), path)


def load_tasks(cfg: TasksConfig, workdir: Path) -> tuple[list[QATask], Path]:
    """The tasks and the passage corpus (JSONL) the search service should serve."""
    from agentrl.engine import tasks as T

    if cfg.source == "synthetic":
        world, tasks = T.synthetic_tasks(split=cfg.split, num=cfg.num, hops=cfg.hops, seed=0,
                                         config=T.SyntheticQAConfig(seed=cfg.seed, num_companies=cfg.num_companies))
        corpus = Path(cfg.corpus) if cfg.corpus else world.write_corpus(workdir / "synthetic_corpus.jsonl")
        return tasks, corpus
    loaders = {"hotpotqa": T.load_hotpotqa, "2wikimultihopqa": T.load_2wikimultihopqa, "musique": T.load_musique}
    if cfg.source not in loaders:
        raise ValueError(f"[tasks] source must be 'synthetic' or one of {sorted(loaders)}, got {cfg.source!r}")
    if not cfg.path:
        raise ValueError(f"[tasks] source = {cfg.source!r} needs path = the dataset file")
    tasks, passages = loaders[cfg.source](cfg.path, limit=cfg.num)
    corpus = Path(cfg.corpus) if cfg.corpus else T.write_passages(passages, workdir / f"{cfg.source}_contexts.jsonl")
    return tasks, corpus


class Services:
    """Starts what the config does not point at (a vLLM server, a search service), connects to all,
    and stops what it started, by PID, on exit."""

    def __init__(self, config: RunConfig, corpus: Path):
        self.config, self.corpus = config, corpus
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self):
        from transformers import AutoTokenizer

        from agentrl.common.model import resolve_model
        from agentrl.engine.chat import ChatFormat
        from agentrl.engine.env import ToolEnv
        from agentrl.engine.pool import ServerPool
        from agentrl.engine.tools import remote_tools
        from agentrl.toolservers.client import ToolClient

        cfg = self.config
        await self._stack.__aenter__()
        try:
            servers = list(cfg.inference.servers)
            model_dir = str(resolve_model(cfg.inference.model_dir or None))
            if not servers:
                from agentrl.engine.serve import VLLMServer, VLLMServerConfig

                server = VLLMServer(VLLMServerConfig(model_dir=model_dir, max_model_len=cfg.inference.max_model_len))
                print(f"starting a vLLM server for {model_dir} (log {server.log_path}) ...", file=sys.stderr)
                self._stack.callback(server.stop)  # registered first: a start that times out still stops its process group
                await asyncio.to_thread(server.start)
                print(f"vLLM server pid {server.pid} at {server.base_url}", file=sys.stderr)
                servers = [server.base_url]
            endpoints = list(cfg.tools.search_endpoints)
            if not endpoints:
                from agentrl.toolservers.process import start_toolserver

                proc = await asyncio.to_thread(start_toolserver, "search", "tcp://127.0.0.1:*", "--corpus", str(self.corpus))
                self._stack.callback(proc.stop)
                endpoints = [proc.endpoint]
            self.pool = await self._stack.enter_async_context(ServerPool(servers))
            self.tool_client = await self._stack.enter_async_context(ToolClient(endpoints, request_timeout_s=cfg.tools.request_timeout_s))
            self.chat = ChatFormat(AutoTokenizer.from_pretrained(model_dir))
            self.tools = await remote_tools(self.tool_client)
            self.env = ToolEnv(self.chat, cfg.env)
            for tool in self.tools:
                self.env.register_tool(tool)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc):
        await self._stack.aclose()


def _summary(trajectories) -> dict:
    n = len(trajectories)
    ok = [t for t in trajectories if t.status != "failed"]
    return {
        "em": sum(t.metrics.get("em", 0.0) for t in trajectories) / max(n, 1),
        "f1": sum(t.metrics.get("f1", 0.0) for t in trajectories) / max(n, 1),
        "n": n,
        "num_failed": n - len(ok),
        "valid_call_rate": sum(t.metrics.get("process/valid_call", 0.0) > 0 for t in trajectories) / max(n, 1),
        "mean_turns": sum(len(t.turns) for t in trajectories) / max(n, 1),
    }


async def _run_with_tools(services: Services, tasks: list[QATask], config: RunConfig, sink=None) -> list:
    from agentrl.engine.orchestrator import Orchestrator

    out = []

    async def collect(group):
        out.extend(group.trajectories)
        if sink is not None:
            await sink(group)

    orch = Orchestrator(services.env, services.pool.generate, collect, dataclasses.replace(config.orchestrator, sampling=config.sampling))
    stats = await orch.run(tasks)
    if stats.num_episodes_started != stats.num_episodes_finished:
        raise RuntimeError(f"{stats.num_episodes_started} episodes started but {stats.num_episodes_finished} finished")
    return out


async def run_naive_rag(tools: list, chat, pool, tasks: list[QATask], config: RunConfig, top_k: int = 3) -> list:
    """Naive RAG: retrieve once with the question, put the passages in the prompt, answer in one turn."""
    from agentrl.engine.chat import NAIVE_RAG_EXAMPLE_MESSAGES, NAIVE_RAG_SYSTEM_PROMPT
    from agentrl.engine.env import ToolEnv, format_content
    from agentrl.engine.orchestrator import Orchestrator

    search = next((t for t in tools if t.name == "search"), None)
    if search is None:
        raise RuntimeError("Naive RAG needs a 'search' tool; the tool services offer " + ", ".join(t.name for t in tools))
    results = await asyncio.gather(*(search.execute({"query": t.question, "top_k": top_k}) for t in tasks))
    contexts = {}
    for task, result in zip(tasks, results, strict=True):
        if not result.success:
            raise RuntimeError(f"Naive RAG retrieval failed for {task.task_id}: {result.error}")
        contexts[task.task_id] = f"Passages:\n{format_content(result.content)}\n\nQuestion: {task.question}"
    env_cfg = dataclasses.replace(config.env, max_turns=1, plain_text_is_answer=True)
    env = ToolEnv(chat, env_cfg, system_prompt_text=NAIVE_RAG_SYSTEM_PROMPT, example_messages=NAIVE_RAG_EXAMPLE_MESSAGES)
    out = []

    async def collect(group):
        out.extend(group.trajectories)

    orch = Orchestrator(env, pool.generate, collect, dataclasses.replace(config.orchestrator, sampling=config.sampling),
                        user_content=lambda t: contexts[t.task_id])
    await orch.run(tasks)
    return out


def _common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML run config (default: the embedded synthetic held-out eval)")
    parser.add_argument("--limit", type=int, help="evaluate at most N questions")
    parser.add_argument("--servers", help="comma-separated vLLM base URLs to use instead of starting one")
    parser.add_argument("--search", help="comma-separated search service endpoints to use instead of starting one")
    parser.add_argument("--temperature", type=float, help="sampling temperature (0 = greedy, the eval default)")


def _apply_args(config: RunConfig, args) -> None:
    if args.limit is not None:
        config.tasks.num = args.limit
    if args.servers:
        config.inference.servers = args.servers.split(",")
    if args.search:
        config.tools.search_endpoints = args.search.split(",")
    if args.temperature is not None:
        config.sampling.temperature = args.temperature


def eval_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl eval", description=__doc__.split("\n\n")[0])
    _common_args(parser)
    parser.add_argument("--no-baselines", action="store_true", help="skip the Naive RAG baseline")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(args.config)
    _apply_args(config, args)
    return asyncio.run(_eval(config, baselines=not args.no_baselines))


async def _eval(config: RunConfig, baselines: bool) -> int:
    from agentrl.common.model import default_model_dir, resolve_model

    with tempfile.TemporaryDirectory(prefix="agentrl-eval-") as workdir:
        tasks, corpus = load_tasks(config.tasks, Path(workdir))
        start = time.perf_counter()
        async with Services(config, corpus) as services:
            policy = _summary(await _run_with_tools(services, tasks, config))
            print(f"policy with tools: em={policy['em']:.3f} f1={policy['f1']:.3f} n={policy['n']} "
                  f"failed={policy['num_failed']} valid_call_rate={policy['valid_call_rate']:.2f}")
            report = {**policy}
            is_base = str(resolve_model(config.inference.model_dir or None)) == str(default_model_dir())
            if baselines:
                if is_base:  # the untrained model with tools *is* the Base Tool Call baseline
                    report.update({f"base_tool_call_{k}": v for k, v in policy.items() if k in ("em", "f1", "n")})
                    print(f"Base Tool Call (untrained model with tools, same run): em={policy['em']:.3f} f1={policy['f1']:.3f}")
                rag = _summary(await run_naive_rag(services.tools, services.chat, services.pool, tasks, config))
                print(f"Naive RAG: em={rag['em']:.3f} f1={rag['f1']:.3f} n={rag['n']} failed={rag['num_failed']}")
                report.update({f"naive_rag_{k}": v for k, v in rag.items() if k in ("em", "f1", "n", "num_failed")})
        report.update(source=config.tasks.source, split=config.tasks.split, temperature=config.sampling.temperature,
                      wall_s=round(time.perf_counter() - start, 1))
    print(json.dumps(report))
    return 0 if report["num_failed"] == 0 else 1


def trajectory_record(traj, chat=None) -> dict:
    """A trajectory as one JSON-able dict (arrays as lists; `text` decoded when a ChatFormat is given)."""
    rec = dataclasses.asdict(traj)
    for name in ("token_ids", "is_action", "behavior_logprobs", "policy_versions"):
        rec[name] = getattr(traj, name).tolist()
    if chat is not None:
        rec["text"] = chat.decode(rec["token_ids"])
    return rec


def rollout_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl rollout", description="run episodes and write their trajectories as JSONL")
    _common_args(parser)
    parser.add_argument("--out", required=True, help="output JSONL path (one trajectory per line)")
    parser.add_argument("--group-size", type=int, help="samples per prompt")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(args.config)
    if args.config is None:
        config.sampling.temperature = 1.0
    _apply_args(config, args)
    if args.group_size:
        config.orchestrator.group_size = args.group_size
    return asyncio.run(_rollout(config, Path(args.out)))


async def _rollout(config: RunConfig, out_path: Path) -> int:
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="agentrl-rollout-") as workdir, out_path.open("w") as out:
        tasks, corpus = load_tasks(config.tasks, Path(workdir))
        async with Services(config, corpus) as services:

            async def write(group):
                for traj in group.trajectories:
                    out.write(json.dumps(trajectory_record(traj, services.chat)) + "\n")
                out.flush()

            trajectories = await _run_with_tools(services, tasks, config, sink=write)
    report = _summary(trajectories)
    report["out"] = str(out_path)
    print(json.dumps(report))
    return 0
