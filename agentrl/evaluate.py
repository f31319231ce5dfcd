"""`agentrl eval` and `agentrl rollout`: the actor side without a learner, on the same config as `agentrl train`.

    agentrl eval    [--model DIR] [--config FILE] [--set K=V ...] [--limit N] [--temperature T]
                    [--vllm URL ...] [--tool-endpoint EP ...] [--no-baselines]
    agentrl rollout --out FILE.jsonl [--split heldout|train] [--group-size N] [same options]

The config resolves exactly as for `agentrl train` (agentrl/runconfig.py), so `--config
runs/X/config.toml` evaluates a run's held-out set with its environment. `--model DIR` evaluates
that policy; a folder written by `agentrl export` carries the run's config, which is then the
default `--config`. Whatever the config does not point at (a vLLM server, the tool services) is
started here and stopped by PID on exit.

`eval` reports, for the policy with tools (= Base Tool Call when the policy is the untrained
model) and for the Naive RAG baseline, EM and F1; the last line is one JSON object. `rollout`
writes every trajectory (token ids, masks, log-probs, versions, decoded text) as JSONL.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

from agentrl.common.config import ConfigError
from agentrl.runconfig import load_run_config

EXPORTED_CONFIG = "agentrl/config.toml"
"""Where an exported policy folder keeps the config of the run that trained it (agentrl/export.py)."""


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--model", help="HF folder of the policy (default: the config's model_dir, else the prepared SmolLM2)")
    parser.add_argument("--config", help="run config layered over the embedded default (default: the exported model's, if any)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY.PATH=VALUE", help="override one key")
    parser.add_argument("--limit", type=int, help="at most N tasks")
    parser.add_argument("--temperature", type=float, help="sampling temperature (eval default: greedy)")
    parser.add_argument("--vllm", action="append", default=[], help="use this vLLM server (repeatable)")
    parser.add_argument("--tool-endpoint", action="append", default=[], help="use this tool service (repeatable)")
    return parser


def _resolve(args):
    config_file = args.config
    if config_file is None and args.model and (Path(args.model) / EXPORTED_CONFIG).is_file():
        config_file = str(Path(args.model) / EXPORTED_CONFIG)
    sets: list = list(args.sets)
    if args.model:
        sets.append((f"model_dir={json.dumps(str(Path(args.model).resolve()))}", f"--model {args.model}"))
    if args.vllm:
        sets.append((f"services.vllm={json.dumps(args.vllm)}", "--vllm " + " ".join(args.vllm)))
    if args.tool_endpoint:
        sets.append((f"services.tool_endpoints={json.dumps(args.tool_endpoint)}", "--tool-endpoint " + " ".join(args.tool_endpoint)))
    return load_run_config(config_file, sets).config


async def _with_services(config, workdir: Path, body):
    from agentrl.common.model import resolve_model
    from agentrl.engine.environments import env_class
    from agentrl.engine.services import Connections, start_services
    from agentrl.engine.tasksets import load_taskset

    taskset = load_taskset(config.tasks, workdir / "tasks")
    model_dir = str(resolve_model(config.model_dir or None))
    services = await start_services(config.services, tools=config.tools, env_required=env_class(config.env).required_tools,
                                    model_dir=model_dir, corpus=taskset.corpus, logs=workdir / "logs",
                                    say=lambda line: print(line, file=sys.stderr, flush=True))
    try:
        async with Connections(services.vllm_urls, services.remote, model_dir, config.env, services.local) as conn:
            return await body(conn, taskset, model_dir)
    finally:
        await asyncio.to_thread(services.stop)


def _run(parser: argparse.ArgumentParser, argv: list[str], command) -> int:
    """Parse `argv`, resolve the config (exit 2 naming what is wrong) and run `command(config, args)`."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = _resolve(args)
    except ConfigError as err:
        print(f"{parser.prog}: bad config:\n{err}", file=sys.stderr)
        return 2
    return asyncio.run(command(config, args))


def eval_main(argv: list[str]) -> int:
    parser = _parser("agentrl eval", "Evaluate a policy on the held-out tasks (EM/F1), with the baselines.")
    parser.add_argument("--no-baselines", action="store_true", help="skip the Naive RAG baseline")
    return _run(parser, argv, _eval)


async def _eval(config, args) -> int:
    from agentrl.common.model import default_model_dir
    from agentrl.engine.evaluation import GREEDY, evaluate_baselines, run_tasks, summarize
    from agentrl.engine.orchestrator import OrchestratorConfig

    start = time.perf_counter()

    async def body(conn, taskset, model_dir):
        tasks = taskset.heldout[: args.limit] if args.limit else taskset.heldout
        orch = GREEDY if args.temperature is None else OrchestratorConfig(
            group_size=1, max_concurrent_episodes=256,
            sampling=dataclasses.replace(config.orchestrator.sampling, temperature=args.temperature))
        trajectories = await run_tasks(conn.env, conn.pool, tasks, orch, run_id="eval")
        policy = summarize("policy", conn.env, tasks, trajectories)
        print(f"policy with tools: {policy['score_metric']}={policy['score']:.3f} n={policy['n']} "
              f"failed={policy['num_failed']} valid_call_rate={policy['valid_call_rate']:.2f}", file=sys.stderr)
        report = {k: v for k, v in policy.items() if k not in ("label", "time")}
        if not args.no_baselines:
            if Path(model_dir).resolve() == default_model_dir().resolve():  # the untrained model with tools *is* Base Tool Call
                report.update({"base_tool_call_score": policy["score"], "base_tool_call_n": policy["n"]})
            for name, (baseline, _) in (await evaluate_baselines(conn, tasks)).items():
                print(f"{name}: {baseline['score_metric']}={baseline['score']:.3f} n={baseline['n']}", file=sys.stderr)
                report.update({f"{name}_{k}": baseline[k] for k in ("score", "n", "num_failed", *(("em", "f1") if "em" in baseline else ()))})
        report.update(model=model_dir, loader=config.tasks.loader,
                      temperature=0.0 if args.temperature is None else args.temperature)
        return report

    with tempfile.TemporaryDirectory(prefix="agentrl-eval-") as workdir:
        report = await _with_services(config, Path(workdir), body)
    report["wall_s"] = round(time.perf_counter() - start, 1)
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
    parser = _parser("agentrl rollout", "Run episodes and write their trajectories as JSONL.")
    parser.add_argument("--out", required=True, help="output JSONL path (one trajectory per line)")
    parser.add_argument("--split", choices=("heldout", "train"), default="heldout", help="which tasks (default: heldout)")
    parser.add_argument("--group-size", type=int, default=1, help="samples per task")
    return _run(parser, argv, _rollout)


async def _rollout(config, args) -> int:
    import itertools

    from agentrl.engine.evaluation import run_tasks, summarize
    from agentrl.engine.orchestrator import OrchestratorConfig

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    temperature = config.orchestrator.sampling.temperature if args.temperature is None else args.temperature

    async def body(conn, taskset, model_dir):
        limit = args.limit or len(taskset.heldout)
        if args.split == "heldout":
            tasks = taskset.heldout[:limit]
        else:
            tasks = list(itertools.islice(taskset.train_stream(lambda: 0), limit))
        orch = OrchestratorConfig(group_size=args.group_size, max_concurrent_episodes=256,
                                  sampling=dataclasses.replace(config.orchestrator.sampling, temperature=temperature))
        with out_path.open("w") as out:
            async def write(group):
                for traj in group.trajectories:
                    out.write(json.dumps(trajectory_record(traj, conn.chat)) + "\n")
                out.flush()

            trajectories = await run_tasks(conn.env, conn.pool, tasks, orch, run_id="rollout", sink=write)
        return summarize("rollout", conn.env, tasks, trajectories)

    with tempfile.TemporaryDirectory(prefix="agentrl-rollout-") as workdir:
        report = await _with_services(config, Path(workdir), body)
    report["out"] = str(out_path)
    print(json.dumps(report))
    return 0
