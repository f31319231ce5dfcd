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
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from agentrl.budget import eval_extends_deadline_s, final_eval_reserve_s
from agentrl.common.config import ConfigError, dump_toml, to_dict
from agentrl.common.directory import DIRECTORY_FILE
from agentrl.common.files import write_atomic
from agentrl.common.procs import ChildProcess
from agentrl.common.watchdog import RunLock, RunLockedError
from agentrl.credentials import RunCredentials
from agentrl.engine.environments import env_class
from agentrl.engine.services import Connections, Services, start_services
from agentrl.engine.task import TaskError
from agentrl.engine.tasksets import TaskSet, load_taskset
from agentrl.export import PROMPT_FILE
from agentrl.launch.children import write_actor_config, write_learner_config
from agentrl.launch.keeper import ServiceKeeper
from agentrl.phases.baseline import baseline_phase
from agentrl.phases.evaluations import Evaluations, eval_line, write_sample
from agentrl.phases.rl import rl_phase
from agentrl.phases.sft import sft_phase
from agentrl.progress import Progress
from agentrl.runconfig import (
    DEFAULT_CONFIG,
    TrainConfig,
    check_model_fit,
    config_data,
    load_run_config,
    schema_text,
)
from agentrl.summary import finish_run


def make_launcher(config: TrainConfig, out: Path):
    """The launcher `[cluster] launcher` names (agentrl/launch/)."""
    if config.cluster.launcher == "ray":
        from agentrl.launch.ray_launcher import RayLauncher

        return RayLauncher(config.cluster, out)
    from agentrl.engine.roles import LocalLauncher

    return LocalLauncher(config.network.host, learner_ranks=config.cluster.learner.ranks)


class Supervisor:
    """The run's state and processes; the phases (agentrl/phases/) drive it."""

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
        self.evaluations = Evaluations(out, resume=resume, say=self.say)
        self.progress = progress
        self.deadline = 0.0
        self.setup_s = 0.0
        self.diagnostic_s = 0.0
        """Seconds of evaluations after the budget (eval.without_tools, eval.transfer), left out of minutes_after_setup."""
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

    def set_phase(self, name: str) -> None:
        if self.progress is not None:
            self.progress.deadline = self.deadline
            self.progress.set_phase(name)

    def phase_done(self, name: str, result: dict) -> None:
        self.phases[name] = result
        write_atomic(self.phases_path, json.dumps(self.phases, indent=1).encode())

    def log_eval(self, summary: dict, trajectories: list | None = None) -> None:
        """Record an evaluation (agentrl/phases/evaluations.py); one outside the budget moves the deadline."""
        self.deadline += eval_extends_deadline_s(summary, in_budget=self.config.eval.in_budget)
        self.evaluations.record(summary, trajectories)
        if self.progress is not None:
            self.progress.deadline = self.deadline
            self.progress.log_eval(summary)
        self.say(eval_line(summary))

    def final_eval_reserve_s(self) -> float:
        return final_eval_reserve_s(self.evaluations.summaries, in_budget=self.config.eval.in_budget)

    def rl_min_s(self) -> float:
        return self.config.rl_min_share * self.config.minutes * 60

    # -- services and processes
    def prepare(self) -> None:
        """Load the task set (a malformed task stops the run here, before any process starts)."""
        self.taskset: TaskSet = load_taskset(self.config.tasks, self.out / "tasks")
        self.heldout = self.evaluations.heldout = self.taskset.heldout
        self.evaluations.task_metadata = {t.task_id: t.metadata for t in [*self.heldout, *self.taskset.transfer]}

    async def start_services(self) -> None:
        from agentrl.common.model import resolve_model

        cfg = self.config
        self.model_dir = str(resolve_model(cfg.model_dir or None))
        self.control_token = self.credentials.control_token()
        self.services = await start_services(cfg.services, tools=cfg.tools, env_required=env_class(cfg.env).required_tools,
                                             model_dir=self.model_dir, corpus=self.taskset.corpus, logs=self.out / "logs",
                                             say=self.say, host=self.launcher.host, control_token=self.control_token,
                                             tool_keys=self.credentials.tools(), launcher=self.launcher,
                                             served_adapter=served_adapter(cfg, self.model_dir, self.out))
        self.keeper = ServiceKeeper(self.services, self.launcher, cfg.services, self.out, self.directory_path, self.say)
        self.keeper.write_directory()

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(timeout_s=60)
        if self.services is not None:
            self.services.stop()
        self.launcher.close()
        # A SIGKILLed or early-stopped learner leaves its last push's file in /dev/shm
        # (agentrl.common.weights); one restarted mid-run sweeps its predecessor's on its first push.
        from agentrl.common.weights import sweep_weights_dirs

        for path in sweep_weights_dirs():
            self.say(f"removed {path}, left by a stopped process")

    def learner_config(self, phase: str, overrides: dict):
        """The learner's place (its endpoints are free ports there) and its config file: (slot, path, data)."""
        slot = self.launcher.place(f"learner-{phase}", "learner")
        path, data = write_learner_config(self.config, phase, overrides, slot=slot, out=self.out, credentials=self.credentials,
                                          model_dir=self.model_dir, server_urls=self.services.vllm_urls,
                                          services_file=self.directory_path)
        return slot, path, data

    def actor_config(self, learner_data: dict) -> Path:
        return write_actor_config(self.config, learner_data, services=self.services, out=self.out, credentials=self.credentials,
                                  model_dir=self.model_dir, services_file=self.directory_path)

    def start(self, slot, argv: tuple[str, ...], *, control: bool = False):
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

    # -- the phases
    async def run(self) -> dict:
        cfg = self.config
        t0 = time.monotonic()
        await self.start_services()
        self.setup_s = time.monotonic() - t0
        self.deadline = time.monotonic() + cfg.minutes * 60
        async with Connections(self.services.vllm_urls, self.services.remote, self.model_dir, cfg.env,
                               self.services.local, model=self.services.vllm_model or None) as conn, contextlib.AsyncExitStack() as stack:
            self.conn = self.keeper.conn = self.evaluations.conn = conn
            if self.progress is not None:
                self.evaluations.on_progress = lambda progress: setattr(self.progress, "eval_progress", progress)
            if cfg.agent.enabled:  # held-out evaluations run the agent program, greedy, through a gateway of this process
                from agentrl.gateway.agents import agent_episodes

                self.evaluations.episodes = await stack.enter_async_context(
                    agent_episodes(cfg.agent, conn.env, conn.pool, conn.chat.tokenizer, model_dir=self.model_dir, temperature=0.0))
            write_atomic(self.out / PROMPT_FILE, json.dumps(self.prompt(), indent=1).encode())  # for the export
            if "baseline" not in self.phases:
                self.set_phase("baseline evaluation")
                await baseline_phase(self)
            if not cfg.eval.in_budget:
                self.deadline = time.monotonic() + cfg.minutes * 60
            # On --resume the budget applies to what is left to do (a long run continues in slices).
            if cfg.sft.enabled and "sft" not in self.phases:
                await sft_phase(self)
            if "rl" not in self.phases:
                await rl_phase(self)
            self.set_phase("final evaluation")
            summary, trajs = await self.evaluations.of_policy("final")
            self.log_eval(summary, trajs)
            if trajs is not None:
                write_sample(self.out / "trajectories_final.jsonl", trajs[:8], conn.chat)
            self.phase_done("final", summary)
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
        self.set_phase(title)
        t1 = time.monotonic()
        summary, trajs = await self.evaluations.run(tasks, label, env=env)
        self.log_eval(summary, trajs)
        self.phase_done(label, summary)
        self.diagnostic_s += time.monotonic() - t1

    def prompt(self) -> dict:
        """What the policy sees before each task: system prompt, worked example, tool schemas."""
        env = self.conn.env
        examples = env.example_messages() if env.config.shows_worked_example else ()
        return {"system_prompt": env.system_prompt, "example_messages": [list(m) for m in examples],
                "tools": [t.schema() for t in env.tools.values()], "user_prefix": env.user_prefix}


def served_adapter(config: TrainConfig, model_dir: str, out: Path) -> Path | None:
    """With vLLM's own LoRA path (`services.vllm_server.lora = "vllm"`): the adapter the server
    starts with, all zeros (the base model's outputs until the first push), written into
    RUN_DIR/adapters/initial at each start (an absolute path: a server on another host reads it
    from the shared run directory); None otherwise."""
    if config.services.vllm_server.lora != "vllm":
        return None
    from agentrl.common.adapters import identity_adapter, peft_adapter_config, write_peft_folder
    from agentrl.learner.lora import lora_layer_indices, model_layer_modules

    lora, folder = config.learner.trainer.lora, (out / "adapters" / "initial").resolve()
    layers = lora_layer_indices(model_layer_modules(model_dir)[1], config.learner.trainer.train_layers)
    tensors = identity_adapter(Path(model_dir), lora.rank, list(lora.target_modules), layers)
    return write_peft_folder(folder, tensors, peft_adapter_config(lora.rank, lora.alpha, list(lora.target_modules),
                                                                  layers, model_dir))


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
