"""`agentrl train`: the whole job. A supervisor that starts the services, the actor (orchestrator)
and the learner as separate processes, drives the phases, evaluates, and writes the report.

    agentrl train [--config FILE] [--set KEY.PATH=VALUE ...] [--print-config] [--minutes M]
                  [--out DIR] [--resume DIR] [--vllm URL ...] [--tool-endpoint tcp://... ...]

The config is resolved and checked before anything starts (agentrl/runconfig.py: the embedded
default, then --config, then each --set; `--help` lists every key). Phases:
1. set-up: the task set (the synthetic world and its corpus by default), the tool services and a
   vLLM server unless given (engine/services.py). Not counted in the time budget; everything after
   it is (`minutes`).
2. held-out evaluation of the untrained policy with tools (Base Tool Call) and of Naive RAG, or
   their results from an earlier run with the same key (agentrl/evalcache.py). With an `[agent]`,
   every held-out evaluation of the policy runs the agent program (greedy, through a gateway in
   this process), and RL episodes are the agent's (the actor serves its own gateway).
3. SFT cold start (when the task set offers demonstrations): gold trajectories are streamed to a
   learner process in `sft` mode; it pushes its weights to the servers when done; held-out
   evaluation. It stops early (checkpointing the step reached) when only its evaluation, the final
   one and `rl_min_share` of the budget are left.
4. asynchronous RL: a learner process (`rl` mode, initialised from the SFT checkpoint) and an actor
   process (engine/actor.py) run side by side; the learner pushes weights every step while rollouts
   continue. The supervisor evaluates on the held-out set every `eval.every_s` while evaluations stay
   within `eval.max_share` of the budget, restarts a learner that died (it resumes from its
   checkpoint and spool, so no group is lost or trained twice), a vLLM server or tool service that
   died (at its endpoint; the learner pushes a server the latest weights when it answers), and stops
   the learner and the actor early enough that the final evaluation still fits in the time budget.
   A phase shorter than `rl_min_share` of the budget is announced with the `--minutes` that would
   give it that share; under a minute, it is skipped, and the report and JSON line say that RL did
   not run.
5. final evaluation (not run again when the served weights are the ones the SFT evaluation measured:
   that result stands), the policy exported as a Hugging Face folder (RUN_DIR/hf), `report.md` with
   plots and the time each phase took, and one JSON line last. Opt-in diagnostics after the budget:
   `eval.without_tools`, `eval.transfer`.

The learners, the vLLM server and the tool services bind `[network] host` (loopback by default).
CurveZMQ keys in `[learner.transport]` (curve_secret_key_file, curve_authorized_clients_dir) switch it on for
the learners; the supervisor then makes a client certificate for its actor and SFT stream in
RUN_DIR/curve/ (agentrl/credentials.py). Off loopback it makes the learners' and the tool
services' certificates too and a control token; on loopback without keys, none.

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
import json
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from agentrl.budget import (
    CLEAN_EVALUATIONS,
    MIN_RL_PHASE_S,
    MIN_SFT_PHASE_S,
    eval_extends_deadline_s,
    evenly_spaced,
    final_eval_reserve_s,
    rl_eval_fits,
    rl_shortfall_message,
    sft_stop_at,
)
from agentrl.common.config import ConfigError, dump_toml, layer, to_dict
from agentrl.common.directory import DIRECTORY_FILE
from agentrl.common.files import read_jsonl, write_atomic
from agentrl.common.procs import ChildProcess
from agentrl.common.trajectory import single_group
from agentrl.common.watchdog import RunLock, RunLockedError
from agentrl.credentials import RunCredentials
from agentrl.engine.environments import env_class
from agentrl.engine.evaluation import GREEDY, evaluate, evaluate_baselines
from agentrl.engine.roles import agentrl_argv
from agentrl.engine.services import Connections, Services, start_services
from agentrl.engine.task import TaskError
from agentrl.engine.tasksets import TaskSet, load_taskset
from agentrl.launch.keeper import ServiceKeeper
from agentrl.progress import Progress
from agentrl.runconfig import (
    DEFAULT_CONFIG,
    TrainConfig,
    check_model_fit,
    config_data,
    load_run_config,
    schema_text,
    sft_learner_overrides,
)
from agentrl.summary import finish_run, last_metrics

ANCHOR_DIR = "rl-anchor"
"""Run folder of the SFT demonstrations the RL learner's anchor trains on (learner.anchor.coef > 0)."""


def make_launcher(config: TrainConfig, out: Path):
    """The launcher `[cluster] launcher` names (agentrl/launch/)."""
    if config.cluster.launcher == "ray":
        from agentrl.launch.ray_launcher import RayLauncher

        return RayLauncher(config.cluster, out)
    from agentrl.engine.roles import LocalLauncher

    return LocalLauncher(config.network.host)


def write_episode_texts(path: Path, trajectories, chat) -> None:
    """One JSON line per episode: task id, status, reward, error and the whole decoded text (the
    prompt, every action and every tool response), gzip-compressed."""
    import gzip

    with gzip.open(path, "wt") as f:
        for t in sorted(trajectories, key=lambda t: t.task_id):
            f.write(json.dumps({"task_id": t.task_id, "status": t.status, "task_reward": t.task_reward,
                                "error": t.error, "text": chat.decode(t.token_ids.tolist())}) + "\n")


def _write_sample(path: Path, trajectories, chat) -> None:
    with open(path, "w") as f:
        for t in trajectories:
            f.write(json.dumps({"task_id": t.task_id, "status": t.status, "task_reward": t.task_reward, "metrics": t.metrics,
                                "text": chat.decode(t.token_ids.tolist())}) + "\n")


# ---------------------------------------------------------------- the supervisor


class Supervisor:
    def __init__(self, config: TrainConfig, out: Path, *, resume: bool = False, progress: Progress | None = None):
        self.config, self.out, self.resume = config, out, resume
        self.procs: list = []
        """The launcher's slots of the learners and the actor, in start order."""
        self.services: Services | None = None
        self.conn: Connections | None = None
        self.phases_path = out / "phases.json"
        self.phases: dict = json.loads(self.phases_path.read_text()) if resume and self.phases_path.exists() else {}
        self.learner_restarts = 0
        self.keeper: ServiceKeeper | None = None
        """Starts again the services that die, and says where they answer (agentrl/launch/keeper.py)."""
        self.directory_path = (self.out / DIRECTORY_FILE).resolve()
        # Held-out evaluation summaries, oldest first: read once (on --resume), then appended by _log_eval.
        self.evals: list[dict] = read_jsonl(out / "evals.jsonl") if resume else []
        self.progress = progress
        self.deadline = 0.0
        self.setup_s = 0.0
        self.diagnostic_s = 0.0
        """Seconds of evaluations after the budget (eval.without_tools, eval.transfer), left out of minutes_after_setup."""
        self.first_eval_of_this_process = len(self.evals)
        """Evaluations before this index were read back on --resume: another server process measured
        them (a resumed run's fresh server serves version 0 until a learner pushes), and another
        slice of the budget paid for them."""
        self.eval_episodes = None
        """The `[agent]` runner held-out evaluations use (None: native episodes)."""
        self.launcher = make_launcher(config, out)
        """Where each process of the run goes (agentrl/launch/): this host, or a Ray cluster's nodes."""
        self.credentials = RunCredentials(out, host=self.launcher.host, learner_transport=config.learner.transport,
                                          external_vllm=bool(config.services.vllm))
        self.control_token: str | None = None
        """The run's provisioned control token off loopback (`RunCredentials.control_token`), else None."""

    # -- bookkeeping
    def say(self, line: str) -> None:
        if self.progress is not None:
            self.progress.say(line)
        else:
            print(line, flush=True)

    def _phase(self, name: str) -> None:
        if self.progress is not None:
            self.progress.deadline = self.deadline
            self.progress.set_phase(name)

    def _phase_done(self, name: str, result: dict) -> None:
        self.phases[name] = result
        write_atomic(self.phases_path, json.dumps(self.phases, indent=1).encode())

    def _log_eval(self, summary: dict, trajectories: list | None = None) -> None:
        self.deadline += eval_extends_deadline_s(summary, in_budget=self.config.eval.in_budget)
        self.evals.append(summary)
        with open(self.out / "evals.jsonl", "a") as f:
            f.write(json.dumps(summary) + "\n")
        if trajectories is not None:  # per task, so the report can pair two evaluations task by task
            folder = self.out / "evals"
            folder.mkdir(exist_ok=True)
            name = f"{summary['label']}-v{summary['served_version']}.jsonl"
            metric = summary["score_metric"]
            report_by = self.conn.env.report_by if self.conn is not None else ()
            metadata = {t.task_id: t.metadata for t in [*self.heldout, *self.taskset.transfer]}
            with open(folder / name, "w") as f:
                for t in sorted(trajectories, key=lambda t: t.task_id):
                    meta = metadata.get(t.task_id, {})
                    f.write(json.dumps({"task_id": t.task_id, "score": t.metrics.get(metric, 0.0), "status": t.status,
                                        **{k: v for k, v in t.metrics.items() if "/" not in k},
                                        "group": {k: str(meta[k]) for k in report_by if k in meta}}) + "\n")
            if self.conn is not None:  # every episode's text, for reading failures (gzip: ~10x smaller)
                write_episode_texts(folder / name.replace(".jsonl", ".text.jsonl.gz"), trajectories, self.conn.chat)
        if self.progress is not None:
            self.progress.deadline = self.deadline
            self.progress.log_eval(summary)
        extra = f"  F1 {summary['f1']:.3f}" if "f1" in summary else ""
        self.say(f"[eval {summary['label']}] {summary['score_metric']} {summary['score']:.3f}{extra}  n={summary['n']} "
                 f"(served version {summary['served_version']}, {summary['eval_s']:.0f} s)")

    # -- services
    def prepare(self) -> None:
        """Load the task set (a malformed task stops the run here, before any process starts)."""
        self.taskset: TaskSet = load_taskset(self.config.tasks, self.out / "tasks")
        self.heldout = self.taskset.heldout

    async def start_services(self) -> None:
        from agentrl.common.model import resolve_model

        cfg = self.config
        self.model_dir = str(resolve_model(cfg.model_dir or None))
        self.control_token = self.credentials.control_token()
        self.services = await start_services(cfg.services, tools=cfg.tools, env_required=env_class(cfg.env).required_tools,
                                             model_dir=self.model_dir, corpus=self.taskset.corpus, logs=self.out / "logs",
                                             say=self.say, host=self.launcher.host, control_token=self.control_token,
                                             tool_keys=self.credentials.tools(), launcher=self.launcher,
                                             served_adapter=self._served_adapter())
        self.keeper = ServiceKeeper(self.services, self.launcher, cfg.services, self.out, self.directory_path, self.say)
        self.keeper.write_directory()

    def _served_adapter(self) -> Path | None:
        """With vLLM's own LoRA path (`services.vllm_server.lora = "vllm"`): the adapter the server
        starts with, all zeros (the base model's outputs until the first push), written into
        RUN_DIR/adapters/initial at each start (an absolute path: a server on another host reads it
        from the shared run directory); None otherwise."""
        cfg = self.config
        if cfg.services.vllm_server.lora != "vllm":
            return None
        from agentrl.common.adapters import identity_adapter, peft_adapter_config, write_peft_folder
        from agentrl.learner.lora import lora_layer_indices, model_layer_modules

        lora, folder = cfg.learner.trainer.lora, (self.out / "adapters" / "initial").resolve()
        layers = lora_layer_indices(model_layer_modules(self.model_dir)[1], cfg.learner.trainer.train_layers)
        tensors = identity_adapter(Path(self.model_dir), lora.rank, list(lora.target_modules), layers)
        return write_peft_folder(folder, tensors, peft_adapter_config(lora.rank, lora.alpha, list(lora.target_modules),
                                                                      layers, self.model_dir))

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(timeout_s=60)
        if self.services is not None:
            self.services.stop()
        self.launcher.close()
        self._sweep_weights()

    def _sweep_weights(self) -> None:
        """Remove the weights files of stopped learners (a SIGKILLed or early-stopped one leaves its
        last push's file in /dev/shm; agentrl.common.weights). A learner restarted mid-run sweeps its
        dead predecessor's on its own first push."""
        from agentrl.common.weights import sweep_weights_dirs

        for path in sweep_weights_dirs():
            self.say(f"removed {path}, left by a stopped process")

    # -- learner / actor processes
    def _learner_config(self, phase: str, overrides: dict):
        """The learner's place (its endpoints are free ports there) and its config file."""
        slot = self.launcher.place(f"learner-{phase}", "learner")
        base = layer(to_dict(self.config.learner), overrides)
        data = {
            **base,
            "transport": {**base["transport"], **self.credentials.learner()[0],
                          "group_endpoint": slot.free_endpoint(), "version_endpoint": slot.free_endpoint()},
            "output_dir": str(self.out / phase),
            "mode": "sft" if phase == "sft" else "rl",
            "model_dir": self.model_dir,
            "server_urls": self.services.vllm_urls,
            "services_file": str(self.directory_path),
            "progress_bar": False,
            "seed": self.config.seed,
        }
        path = self.out / f"learner-{phase}.toml"
        path.write_text(dump_toml(data))
        from agentrl.learner.service import check_runnable, load_config

        check_runnable(load_config(path), str(path))  # the learner's own rules, in the supervisor
        return slot, path, data

    def _actor_config(self, learner_data: dict) -> Path:
        """Write RUN_DIR/actor.toml: the actor-side sections of the run, the services, and the
        learner's endpoints (with the run's client keys when the learner uses CurveZMQ)."""
        cfg = self.config
        actor_cfg = {
            "vllm": self.services.vllm_urls,
            "vllm_model": self.services.vllm_model,
            "remote_tools": to_dict(self.services.remote),
            "local_tools": to_dict(self.services.local),
            "model_dir": self.model_dir,
            "group_endpoint": learner_data["transport"]["group_endpoint"],
            "version_endpoint": learner_data["transport"]["version_endpoint"],
            **self.credentials.learner()[1],
            "max_group_frame_bytes": cfg.learner.transport.max_group_frame_bytes,
            "out_dir": str(self.out / "actor"),
            "tasks": to_dict(cfg.tasks),
            "env": to_dict(cfg.env),
            "orchestrator": to_dict(cfg.orchestrator),
            "agent": to_dict(cfg.agent),
            "services_file": str(self.directory_path),
        }
        path = self.out / "actor.toml"
        path.write_text(dump_toml(actor_cfg))
        return path

    def _start(self, slot, argv: tuple[str, ...], *, control: bool = False):
        """Start a process of the run in `slot` (a launcher's place); `control`: it pushes weights,
        and gets the run's control token (if any) in its environment."""
        from agentrl.common.control_auth import CONTROL_TOKEN_ENV
        from agentrl.engine.roles import CommandRole

        env = {CONTROL_TOKEN_ENV: self.control_token} if control and self.control_token else {}
        log_path = self.out.resolve() / "logs" / f"{slot.name}.log"
        slot.start(CommandRole(slot.name, argv, str(log_path), env=env, cwd=os.getcwd()))
        self.procs.append(slot)
        self.say(f"started {slot.name}{slot.where} (pid {slot.pid}, log {log_path})")
        return slot

    # -- phases
    async def run(self) -> dict:
        cfg = self.config
        t0 = time.monotonic()
        await self.start_services()
        self.setup_s = time.monotonic() - t0
        self.deadline = time.monotonic() + cfg.minutes * 60
        async with Connections(self.services.vllm_urls, self.services.remote, self.model_dir, cfg.env,
                               self.services.local, model=self.services.vllm_model or None) as conn, contextlib.AsyncExitStack() as stack:
            self.conn = self.keeper.conn = conn
            if cfg.agent.enabled:  # held-out evaluations run the agent program, greedy, through a gateway of this process
                from agentrl.gateway.agents import agent_episodes

                self.eval_episodes = await stack.enter_async_context(
                    agent_episodes(cfg.agent, conn.env, conn.pool, conn.chat.tokenizer, model_dir=self.model_dir, temperature=0.0))
            self._write_prompt()
            if "baseline" not in self.phases:
                self._phase("baseline evaluation")
                await self._baseline_phase()
            if not cfg.eval.in_budget:
                self.deadline = time.monotonic() + cfg.minutes * 60
            # On --resume the budget applies to what is left to do (a long run continues in slices).
            if cfg.sft.enabled and "sft" not in self.phases:
                await self._sft_phase()
            if "rl" not in self.phases:
                await self._rl_phase()
            self._phase("final evaluation")
            summary, trajs = await self._evaluate_policy("final")
            self._log_eval(summary, trajs)
            if trajs is not None:
                _write_sample(self.out / "trajectories_final.jsonl", trajs[:8], conn.chat)
            self._phase_done("final", summary)
            if not cfg.agent.enabled:  # diagnostics of the native environment, after the budget
                if cfg.eval.without_tools:
                    await self._diagnostic("final_without_tools", "evaluation without tools", self.heldout,
                                           conn.env.with_tools_disabled())
                if cfg.eval.transfer and self.taskset.transfer:
                    await self._diagnostic("final_transfer", "transfer evaluation", self.taskset.transfer, conn.env)
        return self.phases

    async def _diagnostic(self, label: str, title: str, tasks, env) -> None:
        """One evaluation of the final policy after the budget; its time goes to diagnostic_s."""
        if label in self.phases:
            return
        self._phase(title)
        t1 = time.monotonic()
        summary, trajs = await self._evaluate(tasks, label, env=env)
        self._log_eval(summary, trajs)
        self._phase_done(label, summary)
        self.diagnostic_s += time.monotonic() - t1

    def _prompt(self) -> dict:
        """What the policy sees before each task: system prompt, worked example, tool schemas."""
        env = self.conn.env
        examples = env.example_messages() if env.config.worked_example else ()
        return {"system_prompt": env.system_prompt, "example_messages": [list(m) for m in examples],
                "tools": [t.schema() for t in env.tools.values()], "user_prefix": env.user_prefix}

    def _write_prompt(self) -> None:
        """The prompt, for the export to put in the model folder."""
        from agentrl.export import PROMPT_FILE

        write_atomic(self.out / PROMPT_FILE, json.dumps(self._prompt(), indent=1).encode())

    def _baseline_cache(self) -> tuple[Path, str, dict] | None:
        """(cache folder, key, key inputs) of the untrained policy's evaluations (agentrl/evalcache.py),
        or None where the cache does not apply: turned off, servers given with --vllm, an [agent]."""
        cfg = self.config
        # Servers and tools from outside the run (--vllm, --tool-endpoint, [[tools]]) may change
        # without anything in the key changing.
        if (not cfg.eval.cache_baselines or cfg.services.vllm or cfg.services.tool_endpoints or cfg.tools
                or cfg.agent.enabled):
            return None
        import inspect

        from agentrl import evalcache
        from agentrl.engine.serve import cfg_dtype

        env_source = inspect.getsourcefile(env_class(cfg.env))  # a plug-in environment's own file
        if env_source is None:  # no source to hash (a compiled module): nothing to key its behaviour on
            return None
        cache_dir = evalcache.default_cache_dir(cfg.eval.cache_dir)
        inputs = evalcache.key_inputs(
            model_dir=self.model_dir, dtype=cfg_dtype(cfg.services.vllm_server.dtype),
            max_model_len=cfg.services.vllm_server.max_model_len,
            env=to_dict(cfg.env), prompt=self._prompt(), tasks=[dataclasses.asdict(t) for t in self._baseline_tasks()],
            decoding=dataclasses.asdict(GREEDY), baselines=["environment"] if cfg.eval.baselines else [],
            files={"env_source": Path(env_source), **({"corpus": self.taskset.corpus} if self.taskset.corpus else {})},
            memo_dir=cache_dir)
        return cache_dir, evalcache.cache_key(inputs), inputs

    async def _baseline_phase(self) -> None:
        """Base Tool Call and the environment's baselines on the held-out tasks, or their cached
        results from an earlier run with the same key."""
        from agentrl import evalcache

        cache = await asyncio.to_thread(self._baseline_cache)  # hashes files: the event loop keeps answering heartbeats
        if cache is not None and (entry := evalcache.lookup(cache[0], cache[1])) is not None:
            evalcache.restore(entry, self.out)
            cached = entry["summaries"]
            result = {"base_tool_call": cached["base_tool_call"], "baselines": cached["baselines"], "cached": entry["path"]}
            self.say(f"baseline evaluations read from the cache: {entry['path']} (same model files, dtype, code, "
                     "prompt, held-out tasks and decoding; eval.cache_baselines = false evaluates again)")
            for summary in [result["base_tool_call"], *result["baselines"].values()]:
                self._log_eval({**summary, "time": time.time(), "cached": True})
            self._phase_done("baseline", result)
            return
        tasks = self._baseline_tasks()
        if len(tasks) < len(self.heldout):
            self.say(f"Base Tool Call and the baselines on {len(tasks)} of the {len(self.heldout)} held-out tasks "
                     "(eval.baseline_questions; the SFT and final evaluations use all of them)")
        summary, trajs = await self._evaluate(tasks, "base_tool_call")
        if len(tasks) < len(self.heldout):
            summary["subset_of"] = len(self.heldout)
        self._log_eval(summary, trajs)
        _write_sample(self.out / "trajectories_base.jsonl", trajs[:8], self.conn.chat)
        result = {"base_tool_call": summary, "baselines": {}}
        if self.config.eval.baselines:
            for name, (baseline, _) in (await evaluate_baselines(self.conn, tasks)).items():
                self._log_eval(baseline)
                result["baselines"][name] = baseline
        failed = summary["num_failed"] + sum(b["num_failed"] for b in result["baselines"].values())
        if cache is not None and failed:
            self.say(f"baseline evaluations not cached: {failed} episodes failed (a tool or server fault is not a result to keep)")
        elif cache is not None:
            name = f"base_tool_call-v{summary['served_version']}"
            files = [f for f in (f"evals/{name}.jsonl", f"evals/{name}.text.jsonl.gz", "trajectories_base.jsonl")
                     if (self.out / f).is_file()]
            path = evalcache.store(cache[0], cache[1], cache[2], {"base_tool_call": summary, "baselines": result["baselines"]},
                                   self.out, files)
            self.say(f"baseline evaluations cached in {path}")
        self._phase_done("baseline", result)

    async def _sft_phase(self) -> None:
        from agentrl.common.curve import load_client_keys
        from agentrl.common.transport import GroupSender

        cfg = self.config
        gold, source = await self._demonstrations()
        if not gold:
            self.say(f"SFT cold start skipped: no demonstrations ({source})")
            if cfg.learner.anchor.coef > 0:  # refused now rather than at the RL phase's start
                await self._write_anchor(gold, source)
            self._phase_done("sft", {"skipped": "no demonstrations"})
            return
        self._phase("sft")
        self.say(f"SFT cold start on {len(gold)} demonstrations from {source}")
        if cfg.learner.anchor.coef > 0:
            await self._write_anchor(gold, source)
        # After SFT come its evaluation, the RL phase's share and the final evaluation.
        reserve_s = 2 * self._final_eval_reserve_s() + self._rl_min_s()
        stop_at = sft_stop_at(time.monotonic(), cfg.sft.max_minutes, self.deadline, reserve_s)
        if stop_at - time.monotonic() < MIN_SFT_PHASE_S:
            self.say(f"SFT cold start skipped: {max(stop_at - time.monotonic(), 0):.0f} s of the budget are left for it "
                     f"(after the SFT and final evaluations and rl_min_share = {cfg.rl_min_share}), less than the "
                     f"{MIN_SFT_PHASE_S:.0f} s a learner needs to start and make a step; a longer --minutes gives it time")
            self._phase_done("sft", {"skipped": "no time left"})
            return
        self.say(f"SFT cold start: up to {cfg.sft.steps} steps, stopped after {(stop_at - time.monotonic()) / 60:.1f} "
                 f"minutes at the latest (the SFT and final evaluations and rl_min_share = {cfg.rl_min_share} of the "
                 "budget come after it)")
        overrides = sft_learner_overrides(cfg.sft)
        slot, config_path, data = self._learner_config("sft", overrides)
        learner = self._start(slot, agentrl_argv("learner", "--config", str(config_path.resolve())), control=True)
        client = self.credentials.learner()[1]
        sender = GroupSender(data["transport"]["group_endpoint"], max_unacked=8,
                             max_frame_bytes=self.config.learner.transport.max_group_frame_bytes,
                             curve=load_client_keys(client.get("curve_server_key"), client.get("curve_client_key")))
        await sender.start()
        t0 = time.perf_counter()
        time_limited = False
        epoch = 0
        try:
            while learner.poll() is None and not time_limited:
                for i, traj in enumerate(gold):
                    if learner.poll() is not None or time_limited:
                        break
                    group = single_group(f"sft-{epoch}-{i}", traj)
                    send = asyncio.ensure_future(sender.send(group))
                    while not send.done():
                        await asyncio.wait([send], timeout=1.0)
                        if learner.poll() is not None:
                            send.cancel()
                            break
                        if time.monotonic() >= stop_at:  # the learner checkpoints and pushes the step it reached
                            self.say(f"SFT stopped by its time limit after {(time.perf_counter() - t0) / 60:.1f} minutes")
                            learner.signal(signal.SIGTERM)
                            time_limited = True
                            send.cancel()
                            break
                        if sender.num_handshakes_refused:  # not retried by ZeroMQ: nothing would ever go through
                            send.cancel()
                            raise RuntimeError(f"the SFT learner refused this run's CurveZMQ key ({self.out / 'curve'}); "
                                               f"its log: {learner.log_path}")
                epoch += 1
        finally:
            await sender.close(timeout_s=2.0)
        if time_limited:
            await asyncio.to_thread(learner.stop, 300)
        rc = learner.poll()
        if rc != 0:
            raise RuntimeError(f"SFT learner exited with {rc}; log {learner.log_path}:\n{learner.log_tail()}")
        steps_done = last_metrics(self.out / "sft" / "metrics.jsonl").get("step", 0)
        sft_s = time.perf_counter() - t0
        summary, trajs = await self._evaluate_policy("sft")
        self._log_eval(summary, trajs)
        self._phase_done("sft", {**summary, "sft_s": sft_s, "steps": cfg.sft.steps,
                                 "steps_done": steps_done, "time_limited": time_limited, "epochs_streamed": epoch})

    async def _demonstrations(self) -> tuple[list, str]:
        """The SFT demonstrations (the `[sft] demonstrations` file's, else the environment's for
        `sft.num_examples` tasks; deterministic) and where they come from."""
        from agentrl.engine.demonstrations import read_demonstrations
        from agentrl.engine.episode import build_demonstration

        cfg, env = self.config, self.conn.env
        if cfg.sft.demonstrations:
            return await read_demonstrations(env, cfg.sft.demonstrations), cfg.sft.demonstrations
        gold = [g for t in self.taskset.demonstration_tasks(cfg.sft.num_examples)
                if (g := await build_demonstration(env, t)) is not None]
        return gold, (f"{type(env).__name__}.demonstration" if gold else
                      f"no [sft] demonstrations file, and {type(env).__name__}.demonstration gives none for these tasks")

    async def _write_anchor(self, gold: list | None = None, source: str = "") -> Path:
        """RUN/rl-anchor: the SFT demonstrations (`gold`, as the SFT phase built them) as a spool of
        one-trajectory groups, for the RL learner's demonstration anchor (learner/anchor.py).
        Written once, by the SFT phase; an RL phase that finds none (a run resumed after its SFT,
        or started from another run's SFT checkpoint: scripts/rl_from_sft.sh) builds them then."""
        from agentrl.learner.ledger import Spool

        path = self.out / ANCHOR_DIR
        if path.is_dir() and any(path.glob("*.grp")):
            return path
        if gold is None:
            gold, source = await self._demonstrations()
        if not gold:
            raise RuntimeError(f"learner.anchor.coef = {self.config.learner.anchor.coef}: the demonstration anchor trains "
                               f"on the SFT demonstrations, and this run has none ({source}); set learner.anchor.coef = 0")
        return Spool.write_whole(path, (single_group(f"anchor-{i}", traj) for i, traj in enumerate(gold)))

    async def _rl_phase(self) -> None:
        cfg = self.config
        rl_s = self.deadline - self._final_eval_reserve_s() - time.monotonic()
        if rl_s < self._rl_min_s():
            self.say(rl_shortfall_message(rl_s, cfg.rl_min_share, cfg.minutes))
        if rl_s < MIN_RL_PHASE_S and not self.resume:  # resumed: its learner pushes the run's checkpoint to the new server
            self.say(f"RL phase skipped: {max(rl_s, 0):.0f} s of the budget are left before the final evaluation, "
                     f"less than the {MIN_RL_PHASE_S:.0f} s a learner and an actor need to make a step")
            self._phase_done("rl", {"skipped": "no time left", "rl_s": 0.0, "rl_steps": 0})
            return
        overrides: dict = {}
        if cfg.sft.enabled and not self.phases.get("sft", {}).get("skipped"):
            overrides["init_checkpoint"] = str(self.out / "sft" / "checkpoints")
        if cfg.learner.anchor.coef > 0:
            overrides["anchor_dir"] = str(await self._write_anchor())
        learner_slot, config_path, data = self._learner_config("rl", overrides)
        actor_path = self._actor_config(data)
        self.keeper.write_directory(data["transport"])
        learner_argv = agentrl_argv("learner", "--config", str(config_path.resolve()))
        self._phase("rl")
        rl_start = time.monotonic()
        rl_eval_s = 0.0  # the RL-phase evaluations' time, counted with the evaluations
        learner = self._start(learner_slot, learner_argv, control=True)
        actor = self._start(self.launcher.place("actor", "actor"), agentrl_argv("actor", "--config", str(actor_path.resolve())))
        next_eval = time.monotonic() + cfg.eval.every_s
        try:
            def rl_end() -> float:  # an evaluation outside the budget moves the deadline
                return self.deadline - self._final_eval_reserve_s()

            self.say(f"RL phase: {max(rl_end() - time.monotonic(), 0) / 60:.1f} minutes")
            while time.monotonic() < rl_end():
                await asyncio.sleep(2.0)
                if actor.poll() is not None:
                    raise RuntimeError(f"actor exited with {actor.poll()}; log {actor.log_path}:\n{actor.log_tail()}")
                await self.keeper.check()
                rc = learner.poll()
                if rc is not None:
                    if rc == 0:
                        self.say("learner finished its max_steps")
                        break
                    if self.learner_restarts >= cfg.services.max_learner_restarts:
                        raise RuntimeError(f"learner died {self.learner_restarts + 1} times; log {learner.log_path}:\n{learner.log_tail()}")
                    self.learner_restarts += 1
                    self.say(f"learner exited with {rc}; restarting it (restart {self.learner_restarts}), "
                             "it resumes from its checkpoint")
                    self.procs.remove(learner)
                    learner = self._start(self.keeper.learner_slot_again(learner, config_path, data), learner_argv, control=True)
                max_eval_s = cfg.eval.max_share * cfg.minutes * 60 if cfg.eval.in_budget else math.inf
                if rl_eval_fits(time.monotonic(), self.evals[self.first_eval_of_this_process:], next_eval_s=next_eval,
                                rl_end_s=rl_end(), in_budget=cfg.eval.in_budget, max_eval_s=max_eval_s):
                    t_eval = time.monotonic()
                    summary, trajs = await self._evaluate(self.heldout, "rl")
                    self._log_eval(summary, trajs)
                    rl_eval_s += time.monotonic() - t_eval
                    next_eval = time.monotonic() + cfg.eval.every_s
        finally:
            # In threads: the event loop must keep answering the tool services' heartbeats.
            await asyncio.to_thread(actor.stop, 30)
            await asyncio.to_thread(learner.stop, 120)
        from agentrl.learner.checkpoint import checkpoint_dirs, checkpoint_step

        first_version = self.phases.get("sft", {}).get("steps_done", 0) if "init_checkpoint" in overrides else 0
        # The latest checkpoint's step, not the last metrics line: a learner killed mid-run leaves
        # lines of steps its successor redoes or never reaches.
        checkpoints = checkpoint_dirs(self.out / "rl" / "checkpoints")
        last_version = checkpoint_step(checkpoints[-1]) if checkpoints else first_version
        self._phase_done("rl", {"learner_restarts": self.learner_restarts, "server_restarts": self.keeper.restarts["inference"],
                                "tool_restarts": self.keeper.restarts["tools"],
                                "learner_rc": learner.poll(), "actor_rc": actor.poll(),
                                "rl_s": time.monotonic() - rl_start - rl_eval_s, "rl_steps": max(last_version - first_version, 0),
                                "first_version": first_version, "last_version": last_version})

    def _baseline_tasks(self) -> list:
        return evenly_spaced(self.heldout, self.config.eval.baseline_questions)

    def _final_eval_reserve_s(self) -> float:
        return final_eval_reserve_s(self.evals, in_budget=self.config.eval.in_budget)

    def _rl_min_s(self) -> float:
        return self.config.rl_min_share * self.config.minutes * 60

    # -- evaluations
    async def _evaluate(self, tasks, label: str, env=None) -> tuple[dict, list]:
        """`evaluate`, with its progress (done/total) on the status line."""
        def on_progress(done: int, total: int) -> None:
            if self.progress is not None:
                self.progress.eval_progress = (label, done, total)

        try:
            return await evaluate(self.conn, tasks, label, env=env, episodes=None if env is not None else self.eval_episodes,
                                  on_progress=on_progress)
        finally:
            if self.progress is not None:
                self.progress.eval_progress = None

    async def _evaluate_policy(self, label: str) -> tuple[dict, list | None]:
        """The held-out evaluation `label` of the served policy, unless the latest clean evaluation
        (baseline, after SFT, final) measured the same served version on the whole held-out set (not a
        baseline on a subset, `eval.baseline_questions`): the same weights, prompt, tasks and greedy
        decoding give the same result, so that one is reused (its per-task files
        copied under this label) and nothing runs: (that summary, None) is returned then. Only this
        process's evaluations count (`first_eval_of_this_process`)."""
        versions = list((await self.conn.pool.weight_versions()).values())
        served = max(versions) if versions else -1
        same = [e for e in self.evals[self.first_eval_of_this_process:]
                if e.get("label") in CLEAN_EVALUATIONS and e.get("served_version") == served and "subset_of" not in e
                and e.get("harness", "native") == ("native" if self.eval_episodes is None else "agent")]
        if not same:
            return await self._evaluate(self.heldout, label)
        earlier = same[-1]
        folder = self.out / "evals"
        for suffix in (".jsonl", ".text.jsonl.gz"):
            source = folder / f"{earlier['label']}-v{served}{suffix}"
            if source.is_file():
                shutil.copyfile(source, folder / f"{label}-v{served}{suffix}")
        self.say(f"evaluation {label} not run: served version {served} is the one the {earlier['label']} evaluation "
                 "measured (same weights, prompt, tasks, greedy decoding); its result stands")
        return {**earlier, "label": label, "time": time.time(), "repeat_of": earlier["label"]}, None


# ---------------------------------------------------------------- entry point


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentrl train", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (TOML tables; --set takes the dotted path):\n" + schema_text())
    parser.add_argument("--config", default=None,
                        help=f"TOML file layered over the embedded default ({DEFAULT_CONFIG.name}): it changes only the keys it names")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="override one key after --config (repeatable; VALUE is a TOML value or a plain string)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    parser.add_argument("--minutes", type=float, default=None, help="same as --set minutes=M")
    parser.add_argument("--out", default=None, help="run directory (default: runs/<timestamp>)")
    parser.add_argument("--resume", default=None, help="continue the run in this directory (its config.toml)")
    parser.add_argument("--vllm", action="append", default=[], help="use this vLLM server (repeatable) instead of starting one")
    parser.add_argument("--tool-endpoint", action="append", default=[], help="use this tool service (repeatable)")
    parser.add_argument("--launcher", choices=("local", "ray"), default=None,
                        help="same as --set cluster.launcher=NAME: where the run's processes go (ray: a Ray cluster's nodes)")
    parser.add_argument("--ray-address", default=None, help="same as --set cluster.address=ADDR (Ray's own address argument)")
    return parser


def resolve_args(args: argparse.Namespace):
    """The resolved config for the command line (ConfigError on any problem)."""
    sets: list = list(args.sets)
    if args.minutes is not None:
        sets.append((f"minutes={args.minutes!r}", f"--minutes {args.minutes}"))
    if args.vllm:
        sets.append((f"services.vllm={json.dumps(args.vllm)}", "--vllm " + " ".join(args.vllm)))
    if args.tool_endpoint:
        sets.append((f"services.tool_endpoints={json.dumps(args.tool_endpoint)}", "--tool-endpoint " + " ".join(args.tool_endpoint)))
    if args.launcher:
        sets.append((f"cluster.launcher={json.dumps(args.launcher)}", f"--launcher {args.launcher}"))
    if args.ray_address:
        sets.append((f"cluster.address={json.dumps(args.ray_address)}", f"--ray-address {args.ray_address}"))
    if args.resume:
        run_config = Path(args.resume) / "config.toml"
        if not run_config.is_file():
            raise ConfigError(f"{args.resume} holds no run (no config.toml)")
        # The run's own resolved config is complete: it is not layered over today's default.
        return load_run_config(run_config, sets, base=None)
    return load_run_config(args.config, sets)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        resolved = resolve_args(args)
    except ConfigError as err:
        print(f"agentrl train: bad config:\n{err}", file=sys.stderr)
        return 2
    if args.print_config:
        print(dump_toml(config_data(resolved.config)), end="")
        return 0
    config = resolved.config
    try:
        check_model_fit(config)
    except (ConfigError, FileNotFoundError) as err:
        print(f"agentrl train: bad config:\n{err}", file=sys.stderr)
        return 2
    fresh = not args.resume and not Path(args.out or "/nonexistent").exists()
    if args.resume:
        out = Path(args.resume)
    else:
        out = Path(args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
        if (out / "config.toml").exists():
            # A second run would append to the first one's evals.jsonl and metrics, and its report
            # would mix the two.
            print(f"agentrl train: {out} already holds a run; continue it with --resume {out}, or choose another --out",
                  file=sys.stderr)
            return 2
        out.mkdir(parents=True, exist_ok=True)
    try:
        lock = RunLock(out).acquire()
    except RunLockedError as err:
        print(f"agentrl train: {err}", file=sys.stderr)
        return 2
    try:
        return _run(args, config, out, fresh, lock)
    finally:
        lock.release()


def _start_watchdog(out: Path, lock: RunLock) -> ChildProcess:
    """The run's watchdog (agentrl/common/watchdog.py): it stops every process of the run if this
    one dies without doing so (SIGKILL), and holds the run lock until they are all gone."""
    argv = [sys.executable, "-P", "-m", "agentrl.common.watchdog", str(os.getpid())]
    return ChildProcess("watchdog", argv, log_path=out / "logs" / "watchdog.log", pass_fds=(lock.fd,)).start()


def _run(args: argparse.Namespace, config: TrainConfig, out: Path, fresh: bool, lock: RunLock) -> int:
    try:
        supervisor = Supervisor(config, out, resume=bool(args.resume))
    except ValueError as err:
        print(f"agentrl train: cannot resume: {err}", file=sys.stderr)
        return 2
    try:
        supervisor.prepare()
    except (ConfigError, TaskError, FileNotFoundError) as err:
        print(f"agentrl train: bad tasks:\n{err}", file=sys.stderr)
        if fresh:
            shutil.rmtree(out)  # created just now and holding nothing of value
        return 2
    (out / "config.toml").write_text(dump_toml(config_data(config)))
    t0 = time.time()

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)  # a closed terminal: stop every process, as on SIGTERM
    watchdog = _start_watchdog(out, lock)

    async def run() -> dict:
        supervisor.progress = Progress(out, config.logging, to_dict(config))
        supervisor.progress.start_loop()
        try:
            return await supervisor.run()
        finally:
            await supervisor.progress.close()

    try:
        phases = asyncio.run(run())
    except ConfigError as err:  # a tool service of the config that could not start
        print(f"agentrl train: {err}\n(logs: {out / 'logs'})", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: stopping every process this run started", file=sys.stderr)
        supervisor.stop_all()
        return 130
    finally:
        supervisor.stop_all()
        watchdog.stop(timeout_s=10)
    summary = finish_run(out, phases, supervisor, started=t0)
    print(json.dumps(summary))
    return 0
