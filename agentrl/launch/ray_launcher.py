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

from agentrl.engine.roles import HOST_LOST, CommandRole, Role, Running, start_role
from agentrl.launch.plan import ClusterConfig, ray_actor_options

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
        self.released = True
        return code

    def log_tail(self, num_lines: int = 30) -> str:
        if self.log_path is not None and self.log_path.exists():  # the run directory: on every node
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        return "(no log)"


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

    def place(self, name: str, kind: str) -> RaySlot:
        import ray
        from ray.exceptions import GetTimeoutError

        options = ray_actor_options(kind, self.cluster)
        watchdog_log = str(self.run_dir / "logs" / f"watchdog-{name}.log")
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        actor = self._host_class.options(name=None, **options).remote(watchdog_log)
        try:
            host, node_id = ray.get([actor.address.remote(), actor.node_id.remote()], timeout=self.cluster.place_timeout_s)
        except GetTimeoutError:
            ray.kill(actor)
            wants = {k: v for k, v in options.items() if k in ("num_cpus", "num_gpus", "resources")}
            raise RayPlacementError(
                f"{name}: no node of the Ray cluster took a {kind} role within {self.cluster.place_timeout_s:.0f} s; it asks "
                f"for {wants} (cluster.{kind}); the cluster has {ray.cluster_resources()} in all and "
                f"{ray.available_resources()} free") from None
        slot = RaySlot(name, kind, actor, host, node_id)
        self.slots.append(slot)
        return slot

    def close(self) -> None:
        """Stop every role still running and release the host actors (and Ray, if this started it)."""
        import ray

        for slot in reversed(self.slots):
            slot.stop(30.0)
        self.slots.clear()
        if self._owns_ray:
            ray.shutdown()
