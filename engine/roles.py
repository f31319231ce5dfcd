"""The roles a run starts, as data a launcher can send to another host; `start_role`, which starts
one on the host it is run on; and `LocalLauncher`, which places every role on this host.

A launcher's `place(name, kind)` gives a slot: `host` (the address roles there bind),
`free_endpoint()` (a free port there), `start(role)` (then `endpoint`, `pid`, `poll()`,
`signal(sig)`, `stop(timeout_s)`, `log_tail()`). `kind` is one of "tools", "inference", "learner",
"actor"; a cluster launcher (agentrl/launch/) uses it to choose the node.

A role's argv may hold two placeholders, filled on the host that starts it: "{host}" (the address
the role binds there) and "{bind}" (a tcp endpoint on a free port of that host). The environment is
the host's own plus `env`; secrets travel in `env` or in files, never on the command line.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agentrl.common.procs import ChildProcess


@dataclass(frozen=True)
class CommandRole:
    """A process started from an argv (a tool service, a learner, the actor)."""

    name: str
    argv: tuple[str, ...]
    log_path: str
    env: dict[str, str] = field(default_factory=dict)
    """Added to the host's environment."""
    ready_prefix: str = ""
    """Wait for a stdout line starting with this ("READY "); its second word is the role's endpoint.
    Empty: the role is started without waiting and has no endpoint."""
    ready_timeout_s: float = 120.0
    term_group: bool = False
    cwd: str | None = None
    first: CommandRole | None = None
    """The role as first started, when this one starts it again at a fixed endpoint (`role_at_endpoint`)."""


@dataclass(frozen=True)
class VLLMRole:
    """A vLLM server (engine/serve.py) bound to the host's address; its endpoint is its base URL."""

    name: str
    config: Any
    """An `engine.serve.VLLMServerConfig`; its `host` is replaced by the host's address."""
    log_path: str
    control_token: str | None = None
    timeout_s: float = 300.0
    first: VLLMRole | None = None
    """The role as first started, when this one starts it again at a fixed endpoint (`role_at_endpoint`)."""


Role = CommandRole | VLLMRole


class Running:
    """A started role on this host: its process, its endpoint, and the child-process answers."""

    def __init__(self, name: str, proc: Any, endpoint: str):
        self.name, self.proc, self.endpoint = name, proc, endpoint

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    @property
    def log_path(self) -> Path:
        return Path(self.proc.log_path)

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        """`sig` to the role's leading process (fault-injection tests send SIGKILL)."""
        if self.proc.poll() is None and self.proc.pid is not None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        return self.proc.stop(timeout_s)

    def log_tail(self, num_lines: int = 30) -> str:
        return self.proc.log_tail(num_lines)


def fill_argv(argv: tuple[str, ...], host: str) -> list[str]:
    """The argv with "{host}" and "{bind}" filled for `host` (each "{bind}" a different free port)."""
    from agentrl.engine.serve import free_port

    return [part.replace("{bind}", f"tcp://{host}:{free_port(host)}") if "{bind}" in part else part.replace("{host}", host)
            for part in argv]


def start_role(role: Role, host: str) -> Running:
    """Start `role` on this host, its endpoints bound to `host`; returns once it is ready (a READY
    line, a healthy server). On failure nothing it started is left running."""
    if isinstance(role, VLLMRole):
        from agentrl.engine.serve import VLLMServer

        server = VLLMServer(replace(role.config, host=host), log_path=role.log_path, control_token=role.control_token)
        server.start(role.timeout_s)
        return Running(role.name, server, server.base_url)
    env = {**os.environ, **role.env} if role.env else None
    argv = fill_argv(role.argv, host)
    if not role.ready_prefix:
        proc = ChildProcess(role.name, argv, log_path=role.log_path, env=env, term_group=role.term_group, cwd=role.cwd).start()
        return Running(role.name, proc, "")
    from agentrl.toolservers.process import ToolServerProcess

    proc = ToolServerProcess(role.name, argv, log_path=role.log_path, env=env, cwd=role.cwd).start()
    line = proc.wait_for_line(role.ready_prefix, role.ready_timeout_s)  # ChildStartError, group killed, on failure
    return Running(role.name, proc, line.split(" ", 1)[1].strip())


def role_at_endpoint(role: Role, endpoint: str | None, label: str) -> Role:
    """`role` to be started again at the `endpoint` it had (its port fixed instead of one the OS
    picks, the host's address still filled in where it starts), logging to NAME-LABEL.log. With
    `endpoint` None (another node: the old port means nothing there), the role as first started,
    its ports picked where it starts again."""
    from urllib.parse import urlsplit

    first = role.first or role
    stem = re.sub(r"-restart\d+$", "", Path(first.log_path).stem)  # started again before: the first name
    log_path = str(Path(first.log_path).with_name(f"{stem}-{label}.log"))
    if endpoint is None:
        return replace(first, log_path=log_path)
    port = urlsplit(endpoint.replace("tcp://", "http://", 1)).port
    if isinstance(first, VLLMRole):
        return replace(first, config=replace(first.config, port=port), log_path=log_path, first=first)
    fixed = "tcp://{host}:" + str(port)
    argv = tuple(arg.replace("tcp://{host}:*", fixed).replace("{bind}", fixed) for arg in first.argv)
    return replace(first, argv=argv, log_path=log_path, first=first)


def agentrl_argv(*args: str) -> tuple[str, ...]:
    """`python -P -m agentrl.cli ARGS` with this interpreter (the same path on every host of a cluster)."""
    return (sys.executable, "-P", "-m", "agentrl.cli", *args)


def torchrun_argv(argv: tuple[str, ...], *, nnodes: int, node_rank: int, nproc_per_node: int, master_addr: str,
                  master_port: int) -> tuple[str, ...]:
    """`argv` (`python -P -m MODULE ARGS`) as one torchrun agent of a static rendezvous: `nnodes`
    agents of `nproc_per_node` ranks each, this one `node_rank`, rank 0 at MASTER_ADDR:MASTER_PORT."""
    if len(argv) < 4 or argv[1:3] != ("-P", "-m"):
        raise ValueError(f"not a `python -P -m MODULE` command line: {argv}")
    return (argv[0], "-P", "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(node_rank),
            "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "static", "--master-addr", master_addr,
            "--master-port", str(master_port), "--shutdown-timeout", str(int(TORCHRUN_SHUTDOWN_S)), "-m", *argv[3:])


TORCHRUN_SHUTDOWN_S = 100.0
"""How long a torchrun agent gives its ranks after a SIGTERM (the learner's rank 0 checkpoints and
pushes then) before it SIGKILLs them: above torchrun's 30 s default, below the 120 s the supervisor
gives a learner to stop, so that torchrun ends its ranks before anyone ends torchrun."""

TORCHRUN_ENV = {"PYTHONSAFEPATH": "1"}
"""What torchrun's ranks get in their environment: torchrun starts them as `python -u -m MODULE`
(no -P), and started from a checkout's root they would import its top-level kernels/ folder as
`kernels`, a Hugging Face package's name."""


HOST_LOST = -1000
"""`poll()` of a slot whose host is gone (a launcher's node lost, or its host actor killed); a
process on this host never reads so."""


class LocalSlot:
    """A place on this host for one role."""

    where = ""
    """Where the slot is, for log lines ("" on this host)."""

    def __init__(self, name: str, host: str):
        self.name, self.host = name, host
        self.running: Running | None = None
        self.role: Role | None = None
        """What it was last started with (a service that died is started again from it)."""

    def free_endpoint(self) -> str:
        from agentrl.engine.serve import free_port

        return f"tcp://{self.host}:{free_port(self.host)}"

    def start(self, role: Role) -> LocalSlot:
        if self.running is not None and self.running.poll() is None:
            raise RuntimeError(f"{self.name}: already running (pid {self.running.pid})")
        if self.running is not None:  # started again: what its dead predecessor left in its group goes first
            self.running.stop(10.0)
        self.role = role
        self.running = start_role(role, self.host)
        return self

    @property
    def endpoint(self) -> str:
        return self.running.endpoint if self.running else ""

    @property
    def pid(self) -> int | None:
        return self.running.pid if self.running else None

    @property
    def log_path(self):
        return self.running.log_path if self.running else None

    def poll(self) -> int | None:
        return self.running.poll() if self.running else None

    def signal(self, sig: int) -> None:
        if self.running is not None:
            self.running.signal(sig)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        return self.running.stop(timeout_s) if self.running else None

    def log_tail(self, num_lines: int = 30) -> str:
        return self.running.log_tail(num_lines) if self.running else "(not started)"


class LocalRanksSlot(LocalSlot):
    """A place on this host for a role of several torchrun ranks (the learner's, `cluster.learner.ranks`):
    its `python -P -m ...` command line is started as one torchrun agent of `ranks` local ranks."""

    def __init__(self, name: str, host: str, ranks: int):
        super().__init__(name, host)
        self.ranks = ranks

    def start(self, role: Role) -> LocalSlot:
        from agentrl.engine.serve import free_port

        argv = torchrun_argv(role.argv, nnodes=1, node_rank=0, nproc_per_node=self.ranks, master_addr=self.host,
                             master_port=free_port(self.host))
        return super().start(replace(role, argv=argv, env={**role.env, **TORCHRUN_ENV}))


class LocalLauncher:
    name = "local"

    def __init__(self, host: str = "127.0.0.1", *, learner_ranks: int = 1):
        self.host = host
        """The address every role binds (`[network] host`)."""
        self.learner_ranks = learner_ranks
        """torchrun ranks of each learner (`cluster.learner.ranks`)."""

    def place(self, name: str, kind: str) -> LocalSlot:
        if kind == "learner" and self.learner_ranks > 1:
            return LocalRanksSlot(name, self.host, self.learner_ranks)
        return LocalSlot(name, self.host)

    def close(self) -> None:
        """Nothing to release: each slot's owner stops it."""
