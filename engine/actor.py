"""The actor process of a training run (the orchestrator and its streams); `agentrl actor --config FILE`
starts it (agentrl/actor.py: the entry, which also wires an `[agent]` program's runner).

It connects to the running services (vLLM servers, tool services), builds the task set, and runs
the orchestrator on the training stream forever, sending each finished GRPO group to the learner
(`GroupSender`: acked, resent after a reconnect) and starting episodes only while the servers serve
a version within the staleness bound (`VersionSubscriber`). Every 10 s it appends its counters to
`out_dir/stats.jsonl`. SIGTERM or SIGINT stops it: the run is cancelled, unsent groups are
reported by the sender, and the process exits 0 (the learner's spool already holds what it acked).
A learner that refuses the actor's security handshake (CurveZMQ keys: `curve_server_key`,
`curve_client_key`; agentrl/common/curve.py) stops it with an error within 10 s, since ZeroMQ
does not retry a refused handshake.

Episodes are native unless the config names an agent (`[agent]`, engine/agent.py): then the entry
hands `run_actor` a factory of the agent runner (a gateway served on this process's event loop over
the same server pool, agentrl.gateway.agents), and the orchestrator runs agent episodes under the
same bounds.

The supervisor (`agentrl train`) writes the config: the actor-side sections of the run's config
plus the endpoints it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import field
from pathlib import Path

from agentrl.common.config import config_dataclass
from agentrl.common.curve import ClientKeys, is_local_endpoint, load_client_keys
from agentrl.common.files import write_atomic
from agentrl.common.records import EPISODES_FILE, append_group_record
from agentrl.common.trajectory import TrajectoryGroup
from agentrl.common.transport import DEFAULT_MAX_GROUP_FRAME_BYTES, GroupSender, VersionSubscriber
from agentrl.engine.agent import AgentConfig
from agentrl.engine.curriculum import PassRateCurriculum, SignalMonitor
from agentrl.engine.env import EnvConfig
from agentrl.engine.orchestrator import EpisodeRunner, OrchestratorConfig
from agentrl.engine.services import Connections, RemoteService, ToolSource
from agentrl.engine.tasksets import TasksConfig, load_taskset


@config_dataclass
class ActorConfig:
    vllm: list[str]
    """Base URLs of the vLLM servers."""
    vllm_model: str = ""
    """The `model` every request names: the policy adapter's when the servers serve it with vLLM's
    LoRA path (agentrl.common.adapters.POLICY_ADAPTER); empty: the servers' base model."""
    remote_tools: list[RemoteService] = field(default_factory=list)
    """The tool services to connect to."""
    local_tools: list[ToolSource] = field(default_factory=list)
    """In-process tools (functions, MCP servers) to build here."""
    model_dir: str = ""
    """HF folder of the policy (its tokenizer renders the episodes)."""
    group_endpoint: str = ""
    """The learner's GroupReceiver."""
    version_endpoint: str = ""
    """The learner's VersionPublisher."""
    curve_server_key: str | None = None
    """The learner's zmq.auth public certificate (NAME.key, the public half of its
    curve_secret_key_file) when the learner's sockets use CurveZMQ; needed for a learner on another
    host (it binds off loopback only with keys). Given with curve_client_key."""
    curve_client_key: str | None = None
    """This actor's zmq.auth secret certificate (NAME.key_secret); its public NAME.key must be in the
    learner's curve_authorized_clients_dir."""
    max_group_frame_bytes: int = DEFAULT_MAX_GROUP_FRAME_BYTES
    """Largest frame of a group sent, in bytes: the learner's `max_group_frame_bytes` (its MAXMSGSIZE).
    A larger group is dropped here, logged and counted, since the learner's socket would cut it off."""
    out_dir: str = ""
    """Where stats.jsonl, the task set's files and the episode records of the groups sent
    (episodes.jsonl, agentrl/common/records.py) go."""
    tasks: TasksConfig = field(default_factory=TasksConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    """An agent program run through the gateway instead of native episodes (engine/agent.py)."""
    services_file: str = ""
    """The run's service directory (RUN_DIR/services.json, agentrl.common.directory): a server, tool
    replica or learner that starts again at another address is followed there (read every 2 s).
    Empty: the endpoints above hold for the whole run."""
    signal_window: int = 48
    """Groups over which the stats count those with equal rewards (`signal/recent_equal`; the
    supervisor's `rl.no_signal_groups`)."""

    def __post_init__(self) -> None:
        keys = self.curve_keys()
        for key in ("group_endpoint", "version_endpoint"):
            endpoint = getattr(self, key)
            try:
                remote = bool(endpoint) and not is_local_endpoint(endpoint)
            except ValueError as err:
                raise ValueError(f"{key}: {err}") from None
            if remote and keys is None:
                raise ValueError(f"{key}: {endpoint} is on another host, where the learner binds only with CurveZMQ "
                                 "keys: set curve_server_key (the learner's NAME.key) and curve_client_key (this "
                                 "actor's NAME.key_secret, its NAME.key among the learner's authorized clients)")

    def curve_keys(self) -> ClientKeys | None:
        """The CurveZMQ keys of the learner connections, read and checked (ValueError naming the key)."""
        return load_client_keys(self.curve_server_key, self.curve_client_key)


EpisodesFactory = Callable[[Connections], AbstractAsyncContextManager[EpisodeRunner]]
"""Given the actor's connections, an async context that yields the episode runner (and owns what it serves on)."""


async def run_actor(cfg: ActorConfig, episodes: EpisodesFactory | None = None) -> int:
    from agentrl.engine.orchestrator import Orchestrator

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    taskset = load_taskset(cfg.tasks, out / "tasks")
    async with Connections(cfg.vllm, cfg.remote_tools, cfg.model_dir, cfg.env, cfg.local_tools,
                           model=cfg.vllm_model or None, server_wait_s=cfg.orchestrator.server_wait_s) as conn, \
            contextlib.AsyncExitStack() as stack:
        # The learner's queue is part of the staleness budget: every group waiting there is trained
        # at a later version than the one that sampled it. Bounding the unacknowledged groups to
        # the orchestrator's own in-flight bound keeps data at most ~2 x that many steps old.
        keys = cfg.curve_keys()
        sender = GroupSender(cfg.group_endpoint, max_unacked=cfg.orchestrator.max_groups_in_flight,
                             max_frame_bytes=cfg.max_group_frame_bytes, curve=keys)
        versions = VersionSubscriber(cfg.version_endpoint, curve=keys)
        await sender.start()
        await versions.start()
        follow = asyncio.ensure_future(_follow_directory(cfg, conn, sender, versions)) if cfg.services_file else None
        try:
            runner = await stack.enter_async_context(episodes(conn)) if episodes is not None else None
            draws = TaskDraws(cfg, taskset.train_stream, lambda: (versions.latest or (0, 0))[0], out / CURRICULUM_STATE)

            async def sink(group: TrajectoryGroup) -> None:
                await sender.send(group)
                draws.observe(group)
                # For `agentrl view` and `agentrl rescore` (agentrl/common/records.py).
                append_group_record(out / EPISODES_FILE, group, conn.env.chat)

            orch = Orchestrator(conn.env, conn.pool.generate, sink, cfg.orchestrator, versions=versions,
                                run_id=f"rl{int(time.time())}-{os.getpid()}", episodes=runner)
            stream = draws.stream()
            run = asyncio.ensure_future(orch.run(stream))
            stats_path = out / "stats.jsonl"
            t0 = time.time()
            while not run.done() and not stop.is_set() and not _refused(sender, versions) and not (follow and follow.done()):
                await asyncio.wait([run], timeout=10.0)
                with open(stats_path, "a") as f:
                    f.write(json.dumps({"time": time.time(), "elapsed_s": time.time() - t0, **dataclasses.asdict(orch.stats),
                                        "generated_tokens": conn.pool.num_generated_tokens,
                                        "groups_rejected": sender.num_rejected,
                                        "latest_version": versions.latest, **draws.summary()}) + "\n")
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
        finally:
            try:
                await versions.close()
                await sender.close(timeout_s=5.0)
            finally:
                if follow is not None:  # a failure to follow the directory is raised here, after the closes
                    follow.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await follow
    if refused := _refused(sender, versions):
        # libzmq does not retry a refused handshake: waiting on would send nothing, forever.
        raise RuntimeError(f"the learner refused this actor's connection to {refused} (a CurveZMQ key it does not "
                           "accept, or keys on one side only; the transport's log line above says which): fix "
                           "curve_server_key / curve_client_key or the learner's curve_authorized_clients_dir")
    return 0


CURRICULUM_STATE = "curriculum.json"
"""The curriculum's state in the actor's folder (RUN_DIR/actor): written after every group sent, read
when the actor starts again (`--resume`, or the run's learner moved and the actor with it)."""


class TaskDraws:
    """The training stream the orchestrator draws from: the task set's, through the curriculum by pass
    rate when `orchestrator.curriculum.enabled`; and the signal monitor over the groups sent. The
    curriculum's state is saved (atomically) after every group and restored from the same file."""

    def __init__(self, cfg: ActorConfig, train_stream, version, state_path: Path):
        self.state_path = state_path
        self._stream = lambda: train_stream(version)
        curriculum = cfg.orchestrator.curriculum
        self.monitor = SignalMonitor(cfg.signal_window, curriculum.pass_reward)
        self.curriculum = None
        if curriculum.enabled:
            state = json.loads(state_path.read_text()) if state_path.exists() else None
            self.curriculum = PassRateCurriculum(curriculum, self._stream, state=state)

    def stream(self):
        return self.curriculum.stream() if self.curriculum is not None else self._stream()

    def observe(self, group: TrajectoryGroup) -> None:
        self.monitor.observe(group)
        if self.curriculum is not None:
            self.curriculum.observe(group)
            write_atomic(self.state_path, json.dumps(self.curriculum.state()).encode())

    def summary(self) -> dict[str, float]:
        return {**self.monitor.summary(), **(self.curriculum.summary() if self.curriculum is not None else {})}


async def _follow_directory(cfg: ActorConfig, conn: Connections, sender: GroupSender, versions: VersionSubscriber,
                            interval_s: float = 2.0) -> None:
    """Every `interval_s`, point the connections at the services that moved (agentrl.common.directory)."""
    from agentrl.common.directory import INFERENCE, LEARNER, DirectoryFollower, tools_key

    held = {INFERENCE: list(cfg.vllm), LEARNER: [cfg.group_endpoint, cfg.version_endpoint],
            **{tools_key(s.name): list(s.endpoints) for s in cfg.remote_tools}}
    follower = DirectoryFollower(cfg.services_file, held)
    while True:
        for move in follower.moves():
            if move.key == LEARNER:
                (sender if move.index == 0 else versions).move(move.new)
            else:
                conn.move(move.old, move.new)
        await asyncio.sleep(interval_s)


def _refused(sender: GroupSender, versions: VersionSubscriber) -> str:
    """The learner endpoints (if any) whose security handshake the learner refused."""
    return ", ".join(s.endpoint for s in (sender, versions) if s.num_handshakes_refused)

