"""`RayLauncher`: each role of a run under a host actor on a node of a Ray cluster.

Ray does placement, lifecycle and discovery only. A `RoleHost` actor is placed with the role's
reservation (`plan.ray_actor_options`); on its node it starts the role's process (roles.start_role:
the process binds that node's address and its own ports there) and answers poll / signal / stop /
log_tail for it. Trajectories and weights never pass through Ray: the roles talk ZeroMQ and HTTP as
they do on one host, and they never import Ray themselves.

A host actor also starts the run's watchdog (agentrl/common/watchdog.py) for itself, so when the
actor dies by any means (its driver killed, `ray.kill`, its node's raylet gone) every process it
started dies within seconds; a host that cannot be reached any more reads as exited with
`HOST_LOST`.

Logs: a role writes its log where its `log_path` says, under the run directory, which a run across
hosts keeps on storage every node mounts (README, "A cluster").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from agentrl.engine.roles import (
    HOST_LOST,
    TORCHRUN_ENV,
    CommandRole,
    Role,
    Running,
    start_role,
    torchrun_argv,
)
from agentrl.launch.plan import ClusterConfig, placement_bundles, ray_actor_options

CALL_TIMEOUT_S = 60.0
"""Bound on a call to a host actor other than `start` (a node that stopped answering)."""


class RoleHost:
    """On one node: the role's process and a watchdog that outlives this actor."""

    def __init__(self, watchdog_log: str):
        from agentrl.common.proctable import read_proc

        self.running: Running | None = None
        # What Ray sets for its workers that the role's processes must not take: a breakpoint() that
        # opens Ray's remote debugger. OMP_NUM_THREADS stays: Ray sets it from the reservation.
        if os.environ.get("PYTHONBREAKPOINT", "").startswith("ray."):
            del os.environ["PYTHONBREAKPOINT"]
        # Detached: Ray kills a worker's direct children when it exits, the watchdog among them if it
        # were one, and the role's own children (vLLM's engine processes) would be left behind.
        argv = [sys.executable, "-P", "-m", "agentrl.common.watchdog", str(os.getpid()), "--detach"]
        with open(watchdog_log, "ab") as log:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL)
        line = proc.stdout.readline().decode()
        proc.stdout.close()
        proc.wait()
        if not line.startswith("WATCHDOG "):
            raise RuntimeError(f"the watchdog did not start (exit {proc.returncode}); log {watchdog_log}")
        self.watchdog = read_proc(int(line.split()[1]))

    def address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def free_endpoint(self) -> str:
        from agentrl.engine.serve import free_port

        host = self.address()
        return f"tcp://{host}:{free_port(host)}"

    def start(self, role: Role) -> tuple[int | None, str]:
        if self.running is not None and self.running.poll() is None:
            raise RuntimeError(f"{role.name}: already running (pid {self.running.pid})")
        if self.running is not None:  # started again: what its dead predecessor left in its group goes first
            self.running.stop(10.0)
        self.running = start_role(role, self.address())
        return self.running.pid, self.running.endpoint

    def poll(self) -> int | None:
        return self.running.poll() if self.running else None

    def signal(self, sig: int) -> None:
        if self.running is not None:
            self.running.signal(sig)

    def stop(self, timeout_s: float) -> int | None:
        return self.running.stop(timeout_s) if self.running else None

    def log_tail(self, num_lines: int) -> str:
        return self.running.log_tail(num_lines) if self.running else "(not started)"

    def close(self) -> None:
        """Stop the role, then the watchdog (a clean end: nothing left for it to do)."""
        from agentrl.common.proctable import same_process

        if self.running is not None:
            self.running.stop(30.0)
        if self.watchdog is not None and same_process(self.watchdog):
            os.kill(self.watchdog.pid, signal.SIGTERM)


class RaySlot:
    """A host actor placed for one role, seen from the driver."""

    def __init__(self, name: str, kind: str, actor, host: str, node_id: str, log_path: Path | None = None):
        self.name, self.kind, self.actor, self.host, self.node_id = name, kind, actor, host, node_id
        self.endpoint = ""
        self.pid: int | None = None
        self.log_path = log_path
        self.lost = False
        self.released = False
        self.exit_code: int | None = None
        """The role's exit code as `stop` found it (the host is gone after a stop: `poll` answers this)."""
        self.role: Role | None = None
        """What it was last started with (a service that died is started again from it)."""
        self.where = f" on node {node_id[:12]} ({host})"

    def _call(self, method: str, *args, timeout_s: float = CALL_TIMEOUT_S):
        import ray

        return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout_s)

    def free_endpoint(self) -> str:
        return self._call("free_endpoint")

    def start(self, role: Role) -> RaySlot:
        from ray.exceptions import GetTimeoutError, RayActorError

        # Paths as this driver means them: its working directory is not the host actor's.
        role = replace(role, log_path=str(Path(role.log_path).resolve()))
        if isinstance(role, CommandRole) and role.cwd is None:
            role = replace(role, cwd=os.getcwd())
        timeout_s = getattr(role, "timeout_s", getattr(role, "ready_timeout_s", 120.0)) + CALL_TIMEOUT_S
        self.log_path = Path(role.log_path)
        self.role = role
        try:
            self.pid, self.endpoint = self._call("start", role, timeout_s=timeout_s)
        except (RayActorError, GetTimeoutError) as err:
            self.lost = True
            raise RuntimeError(f"{self.name}: its host{self.where} is gone or does not answer: {err}") from err
        return self

    def poll(self) -> int | None:
        from ray.exceptions import GetTimeoutError, RayActorError

        if self.lost:
            return HOST_LOST
        if self.released:
            return self.exit_code
        try:
            return self._call("poll")
        except (RayActorError, GetTimeoutError):
            self.lost = True
            return HOST_LOST

    def signal(self, sig: int) -> None:
        if not self.lost:
            self._call("signal", sig)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if self.lost or self.released:
            return HOST_LOST if self.lost else None
        try:
            code = self._call("stop", timeout_s, timeout_s=timeout_s + CALL_TIMEOUT_S)
            self._call("close")
        except (RayActorError, GetTimeoutError):
            self.lost = True
            return HOST_LOST
        ray.kill(self.actor)
        self.released, self.exit_code = True, code
        return code

    def stop_process(self, timeout_s: float) -> int | None:
        """Stop the role's process and keep the host (to start it again there)."""
        return None if self.lost else self._call("stop", timeout_s, timeout_s=timeout_s + CALL_TIMEOUT_S)

    def log_tail(self, num_lines: int = 30) -> str:
        if self.log_path is not None and self.log_path.exists():  # the run directory: on every node
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        return "(no log)"


class RayGang:
    """The host actors of one role's torchrun ranks (the learner's, `cluster.learner.ranks`), one per
    bundle of a placement group, seen from the driver as one slot. Bundle 0's node is the role's:
    its endpoints are free ports there, and its torchrun agent holds the static rendezvous (rank 0,
    which binds the learner's sockets and pushes the weights). A rank whose node is lost makes the
    whole gang read as lost (`HOST_LOST`): the ranks cannot go on without it, so the supervisor
    starts the gang again on a new placement group, from the learner's checkpoint."""

    def __init__(self, name: str, kind: str, members: list[RaySlot], group):
        self.name, self.kind, self.members, self.group = name, kind, members, group
        self.host, self.node_id = members[0].host, members[0].node_id
        self.where = members[0].where + "".join(f", rank {i} on node {m.node_id[:12]}" for i, m in enumerate(members) if i)
        self.role: Role | None = None
        self.released = False

    @property
    def endpoint(self) -> str:
        return self.members[0].endpoint

    @property
    def pid(self) -> int | None:
        return self.members[0].pid

    @property
    def log_path(self) -> Path | None:
        return self.members[0].log_path

    def free_endpoint(self) -> str:
        return self.members[0].free_endpoint()

    def start(self, role: Role) -> RayGang:
        """Start `role`'s command line as a torchrun agent on every bundle's node (rank i on bundle i);
        what a dead predecessor left on a node goes first."""
        from urllib.parse import urlsplit

        if not isinstance(role, CommandRole):
            raise TypeError(f"{self.name}: torchrun ranks run a command line, not a {type(role).__name__}")
        for member in self.members:
            if member.pid is not None and member.poll() is None:
                member.stop_process(30.0)
        port = urlsplit(self.free_endpoint().replace("tcp://", "http://", 1)).port
        self.role = role
        for i, member in enumerate(self.members):
            argv = torchrun_argv(role.argv, nnodes=len(self.members), node_rank=i, nproc_per_node=1,
                                 master_addr=self.host, master_port=port)
            log_path = role.log_path if i == 0 else str(Path(role.log_path).with_name(f"{Path(role.log_path).stem}-rank{i}.log"))
            member.start(replace(role, name=role.name if i == 0 else f"{role.name}-rank{i}", argv=argv, log_path=log_path,
                                 env={**role.env, **TORCHRUN_ENV}))
        return self

    def poll(self) -> int | None:
        """HOST_LOST if any rank's node is lost; else rank 0's exit code, or another rank's failure."""
        codes = [member.poll() for member in self.members]  # after `stop`: the codes it found
        if HOST_LOST in codes:
            return HOST_LOST
        if codes[0] is not None:
            return codes[0]
        return next((code for code in codes[1:] if code not in (None, 0)), None)

    def signal(self, sig: int) -> None:
        for member in self.members:
            member.signal(sig)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Stop every rank (rank 0 first: it checkpoints and pushes on SIGTERM), release the host
        actors and the placement group; rank 0's exit code."""
        import ray

        if self.released:
            return self.members[0].exit_code
        try:
            codes = [member.stop(timeout_s) for member in self.members]
        finally:
            ray.util.remove_placement_group(self.group)
            self.released = True
        return codes[0]

    def log_tail(self, num_lines: int = 30) -> str:
        return self.members[0].log_tail(num_lines)


class RayPlacementError(RuntimeError):
    """No node of the cluster offers what a role asks for."""


class RayLauncher:
    name = "ray"

    def __init__(self, cluster: ClusterConfig, run_dir: Path):
        try:
            import ray
        except ImportError:
            raise RuntimeError("cluster.launcher = \"ray\" needs Ray: pip install 'agentrl[ray]'") from None
        self.cluster, self.run_dir = cluster, Path(run_dir).resolve()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=cluster.address or None, log_to_driver=False, include_dashboard=False,
                     configure_logging=False)
        self.host = ray.util.get_node_ip_address()
        """This driver's node address: the run's credentials are made for off-loopback endpoints."""
        self._host_class = ray.remote(RoleHost)
        self.slots: list[RaySlot] = []

    def place(self, name: str, kind: str) -> RaySlot | RayGang:
        """A host actor for one role of `kind` on a node that offers what `[cluster.KIND]` asks; the
        learner with `ranks` > 1: a gang of them, one per bundle of a placement group."""
        if kind == "learner" and self.cluster.learner.ranks > 1:
            return self._place_gang(name, kind)
        slot = self._place_host(name, kind, ray_actor_options(kind, self.cluster))
        self.slots.append(slot)
        return slot

    def _place_host(self, name: str, kind: str, options: dict, placed_by: str = "") -> RaySlot:
        import ray
        from ray.exceptions import GetTimeoutError

        watchdog_log = str(self.run_dir / "logs" / f"watchdog-{name}.log")
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        actor = self._host_class.options(name=None, **options).remote(watchdog_log)
        try:
            host, node_id = ray.get([actor.address.remote(), actor.node_id.remote()], timeout=self.cluster.place_timeout_s)
        except GetTimeoutError:
            ray.kill(actor)
            wants = placed_by or str({k: v for k, v in options.items() if k in ("num_cpus", "num_gpus", "resources")})
            raise RayPlacementError(
                f"{name}: no node of the Ray cluster took a {kind} role within {self.cluster.place_timeout_s:.0f} s; it asks "
                f"for {wants} (cluster.{kind}); the cluster has {ray.cluster_resources()} in all and "
                f"{ray.available_resources()} free") from None
        return RaySlot(name, kind, actor, host, node_id)

    def _place_gang(self, name: str, kind: str) -> RayGang:
        """One placement group of a bundle per rank (`cluster.learner.strategy`), a host actor in each."""
        import ray
        from ray.exceptions import GetTimeoutError
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        wants = self.cluster.learner
        bundles = placement_bundles(wants, wants.ranks)
        group = placement_group(bundles, strategy=wants.strategy)
        try:
            ray.get(group.ready(), timeout=self.cluster.place_timeout_s)
        except GetTimeoutError:
            remove_placement_group(group)
            raise RayPlacementError(
                f"{name}: no {wants.strategy} placement of {wants.ranks} ranks within {self.cluster.place_timeout_s:.0f} s; "
                f"each asks for {bundles[0]} (cluster.{kind}); the cluster has {ray.cluster_resources()} in all and "
                f"{ray.available_resources()} free") from None
        options = {k: v for k, v in ray_actor_options(kind, self.cluster).items() if k != "scheduling_strategy"}
        members = []
        try:
            for i in range(wants.ranks):
                strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i)
                members.append(self._place_host(name if i == 0 else f"{name}-rank{i}", kind,
                                                {**options, "scheduling_strategy": strategy}, placed_by=f"bundle {i}"))
        except BaseException:  # nothing of a gang that could not be placed keeps its reservation
            for member in members:
                member.stop()
            remove_placement_group(group)
            raise
        gang = RayGang(name, kind, members, group)
        self.slots.append(gang)
        return gang

    def close(self) -> None:
        """Stop every role still running and release the host actors (and Ray, if this started it)."""
        import ray

        for slot in reversed(self.slots):
            slot.stop(30.0)
        self.slots.clear()
        if self._owns_ray:
            ray.shutdown()
