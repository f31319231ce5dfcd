"""What keeps a run's services answering: a vLLM server or tool service the run started that dies
is started again (on its node at its endpoint, or on another node of its kind at an address of
that node), and RUN_DIR/services.json says where every service and the learner answer now, for
the actor, the learner and the supervisor's own connections to follow (agentrl/common/directory.py).
The learner's restarts are the supervisor's (they resume from a checkpoint); where a learner whose
node was lost starts again, and its new endpoints, are decided here."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from agentrl.common.config import dump_toml
from agentrl.engine.roles import HOST_LOST, role_at_endpoint


class ServiceKeeper:
    """The run's services kept answering, and where they answer written down (module docstring)."""

    def __init__(self, services, launcher, config, out: Path, directory_path: Path, say: Callable[[str], None]):
        self.services, self.launcher, self.config, self.out, self.say = services, launcher, config, out, say
        """The run's `Services`, its launcher, its `[services]` config (the restart limits)."""
        self.directory_path = directory_path
        self.restarts = {"inference": 0, "tools": 0}
        """Services started again after they died, by kind (`start_again`)."""
        self.learner_endpoints: list[str] = []
        """The RL learner's group and version endpoints, as the directory says them."""
        self.conn = None
        """The supervisor's own `Connections` (its evaluations), moved with a service that moved."""

    async def check(self) -> None:
        """A service the run started that exited is started again (`start_again`)."""
        for slot, code in self.services.exited():
            servers = self.services.vllm_servers
            if slot in servers:
                servers[servers.index(slot)] = await self.start_again(slot, code, "inference")
            else:
                self.services.procs[self.services.procs.index(slot)] = await self.start_again(slot, code, "tools")

    async def start_again(self, slot, code: int, kind: str):
        """Start the vLLM server or tool service of `slot` that exited again: at the same endpoint
        while its node is there; its node lost, on another node of its kind, at an address of that
        node. Those who use it follow: the actor's pool and the learner's publisher probe a server
        (the publisher then pushes it the latest weights; episodes wait for it meanwhile), a tool
        client probes a dead replica (its calls go to the other replicas, or fail as tool errors the
        model sees, meanwhile), and a new address reaches them through the run's service directory
        (`write_directory`). At most `services.max_server_restarts` / `max_tool_restarts` times in a run."""
        server = kind == "inference"
        key = "max_server_restarts" if server else "max_tool_restarts"
        limit, done = getattr(self.config, key), self.restarts[kind]
        what = ("the vLLM server" + ("" if slot.name == "vllm" else " " + slot.name)) if server else "tool service " + slot.name
        why = f"{what}{slot.where} exited with {code} (log {slot.log_path})"
        resume = f"`agentrl train --resume {self.out}` continues the run"
        if done >= limit:
            raise RuntimeError(f"{why}, after {done} restarts (services.{key} = {limit}): {resume}")
        self.restarts[kind] = done + 1
        endpoint, label = slot.endpoint, f"restart{done + 1}"
        self.say(f"{why}; starting it again (restart {done + 1}); "
                 + ("episodes wait for it, then the learner pushes it the latest weights" if server else
                    "its calls go to its other replicas, or fail as tool errors the model sees, until it answers"))
        if not await asyncio.to_thread(stops_listening, endpoint, 60.0):  # a lost node's processes: its watchdog's
            raise RuntimeError(f"{why}, but something still listens at {endpoint} 60 s later: {resume}")
        try:
            new = self.replace_slot(slot, kind)  # the same slot while its host is there (its start clears what is left)
            moved = new is not slot
            await asyncio.to_thread(new.start, role_at_endpoint(slot.role, None if moved else endpoint, label))
        except (RuntimeError, TimeoutError, OSError) as err:  # no node takes it, or it does not start
            raise RuntimeError(f"{why}, and it could not be started again: {err}\n{resume}") from err
        if new.endpoint != endpoint:
            if not moved:
                await asyncio.to_thread(new.stop)
                raise RuntimeError(f"{why}; started again at {new.endpoint}, not at {endpoint}: {resume}")
            self.services.move(endpoint, new.endpoint)
            self.write_directory()  # the actor and the learner follow it there
            if self.conn is not None:  # and so do this process's evaluations
                self.conn.move(endpoint, new.endpoint)
        self.say(f"{'vLLM server' if server else 'tool service ' + slot.name}: {new.endpoint}{new.where} again (pid {new.pid})")
        return new

    def replace_slot(self, slot, kind: str = "learner"):
        """Where a died process of `slot` starts again: the same place while its host is there (its
        endpoints stay valid); a new one of `kind` on another node when the host was lost."""
        if slot.poll() != HOST_LOST:
            return slot
        slot.stop(timeout_s=30)  # what is left of it (a gang's ranks on nodes still there) releases its place
        new = self.launcher.place(slot.name, kind)
        self.say(f"{slot.name}: its host{slot.where} was lost (its node, or the Ray actor that held it); "
                 f"placed again on node {new.node_id[:12]}")
        return new

    def learner_slot_again(self, slot, config_path: Path, data: dict):
        """Where the learner that died starts again (`replace_slot`); on another node, its endpoints
        are free ports there, written into its config and the service directory (the actor follows)."""
        new = self.replace_slot(slot)
        if new is not slot:
            data["transport"].update(group_endpoint=new.free_endpoint(), version_endpoint=new.free_endpoint())
            data["server_urls"] = list(self.services.vllm_urls)  # where the servers answer now
            config_path.write_text(dump_toml(data))
            self.write_directory(data["transport"])
        return new

    def write_directory(self, learner: dict | None = None) -> None:
        """RUN_DIR/services.json: where the run's services answer now, read by the actor and the
        learner to follow one that started again elsewhere (agentrl.common.directory)."""
        from agentrl.common.directory import LEARNER, write_directory

        if learner is not None:
            self.learner_endpoints = [learner["group_endpoint"], learner["version_endpoint"]]
        entries = self.services.directory()
        if self.learner_endpoints:
            entries[LEARNER] = list(self.learner_endpoints)
        write_directory(self.directory_path, entries)


def stops_listening(endpoint: str, timeout_s: float) -> bool:
    """Whether nothing accepts TCP connections at `endpoint` (http://HOST:PORT or tcp://HOST:PORT)
    within `timeout_s`: a service started again must not find its predecessor on its port (a lost
    node's processes go with its watchdog, seconds later), nor take its answers for its own."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(endpoint.replace("tcp://", "http://", 1))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((url.hostname, url.port), timeout=2):
                pass
        except OSError:
            return True
        time.sleep(0.5)
    return False
