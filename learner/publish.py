"""Weight publishing: snapshot on the training thread, write and push to every vLLM server behind it.

Cost split (why the work is where it is): the snapshot (a bf16 copy of 135M parameters, about 0.1 s)
must happen between optimizer steps, because the next step changes the weights in place; the
safetensors write (270 MB) and the HTTP push (stage, pause(keep), layer-wise reload, resume: about
1.2 s per server here) only read the snapshot, so they run in a background task while the next
step trains. Training stalls only for the snapshot, plus the wait for the previous push when pushes
are due faster than they complete (at most one push is in flight: a second would only race the
first onto the same servers). Both stalls are measured and reported (`stall_s`).

The weights go out in bfloat16 (the servers run bf16; half the bytes of fp32). A tied LM head is
not sent: the server ties it to the embedding it receives.

Ownership: the publisher owns its push task and its recovery loop; `wait()` surfaces a failure of
this side (a push error on one server only marks that server down: `WeightPublisher`), and
`close()` bounds shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from agentrl.common.directory import INFERENCE, DirectoryFollower

log = logging.getLogger(__name__)


@dataclass
class PushReport:
    version: int
    total_s: float
    """Background time from snapshot to the last server confirming."""
    write_s: float
    per_server: dict[str, dict[str, float | str]]
    """base URL -> {pause_s, reload_s, stage_s}, for the servers that took the push."""
    failed: dict[str, str] = field(default_factory=dict)
    """base URL -> why the push to it failed (it is marked down)."""


def snapshot_weights(causal_lm: nn.Module, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Checkpoint-named copy of the weights, in `dtype`, on the CPU, without the tied LM head.

    On the CPU, not where the model is: the copy waits there for the background write (a GPU
    learner keeps no second copy of the weights in accelerator memory while the next step trains)."""
    tied = bool(getattr(causal_lm.config, "tie_word_embeddings", False))
    out = {}
    with torch.no_grad():
        for name, tensor in causal_lm.state_dict().items():
            if tied and name == "lm_head.weight":
                continue
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            out[name] = tensor.detach().to(device="cpu", dtype=dtype, copy=True)
    return out


def snapshot_from_policy_state(policy_state: dict[str, torch.Tensor], *, tied: bool, prefix: str = "lm.",
                               dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """`snapshot_weights` from a full `PackedPolicy` state dict (the sharded learner's gather):
    the causal LM's entries under `prefix`, renamed to checkpoint names, in `dtype`, without the
    tied LM head, on the CPU; the value head is the learner's own and is not sent."""
    out = {}
    for name, tensor in policy_state.items():
        if not name.startswith(prefix):
            continue
        name = name[len(prefix):]
        if tied and name == "lm_head.weight":
            continue
        out[name] = tensor.detach().to(device="cpu", dtype=dtype, copy=True)
    return out


class WeightPublisher:
    """Pushes each snapshot to every server that is up; one server's failure is that server's alone.

    Per-server isolation: a push that fails on one server (unreachable, timed out, refused) marks
    that server down (logged, counted in `num_push_failures`); the others still get the weights and
    `served_version` is the oldest version among the servers that are up. The latest weights file
    is kept (one file in /dev/shm, removed before the next push is written unless a server still
    waits for it: a push's size of shared memory for as long as the learner runs), and every
    `probe_interval_s` the
    publisher asks each down server for its version; one that answers is pushed the latest weights
    and is up again. A down server is also asked before each new push, and joins it if it answers.
    The servers that are up are asked too: one that serves a version below the one it was pushed
    was restarted between two pushes (`agentrl train` starts a dead server again at its URL, with
    the base weights), and it is pushed the latest weights like a server that came back. A server
    started again at another address (another node) is followed through the run's service
    directory (`directory`, agentrl.common.directory), read before each recovery round: its old
    URL is dropped, and the new one is pushed the latest weights once it answers.
    `probe` (at start) asks every server for its version concurrently; one that does not answer
    within `probe_timeout_s` is marked down instead of failing the learner.

    All pushes, recovery ones included, run as the one background task (`_task`), so two pushes never
    race onto the same server; the recovery loop only starts one when no push is in flight.
    """

    def __init__(self, server_urls: list[str], *, push_timeout_s: float = 300.0, kv_refresh_every: int = 1,
                 probe_timeout_s: float = 5.0, probe_interval_s: float = 5.0, transport: str = "auto",
                 metadata: dict[str, str] | None = None, directory: DirectoryFollower | None = None):
        if kv_refresh_every < 1:
            raise ValueError(f"kv_refresh_every={kv_refresh_every} must be >= 1")
        self.server_urls = list(server_urls)
        self.push_timeout_s = push_timeout_s
        self.transport = transport
        """How each push reaches a server (agentrl.common.weights.TRANSPORTS)."""
        self.metadata = metadata
        """The header of every push file: what the payload is (None: full weights; an adapter's:
        agentrl.common.adapters.adapter_metadata)."""
        self.kv_refresh_every = kv_refresh_every
        """Every this many pushes, the servers' KV and prefix caches are dropped (running requests
        recompute under the new weights); the pushes in between keep them (agentrl.common.weights, step 3)."""
        self.probe_timeout_s = probe_timeout_s
        """How long a version query to a server may take before it counts as down, seconds."""
        self.probe_interval_s = probe_interval_s
        """How often down servers are asked whether they answer again, seconds."""
        self.directory = directory
        """Where the servers answer now (RUN_DIR/services.json), or None: they never move."""
        self._num_pushes = 0
        self._task: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._latest: tuple[int, Path] | None = None
        """(version, weights file) of the latest push, for a server that comes back (class docstring)."""
        self.versions: dict[str, int] = {}
        """base URL -> the version it serves, for the servers that are up."""
        self.down: dict[str, str] = {}
        """base URL -> why it is marked down (its last failure)."""
        self.num_push_failures: dict[str, int] = {url: 0 for url in self.server_urls}
        self.num_recoveries = 0
        """Down servers that answered again and took the latest weights."""
        self.served_version = 0
        self.on_served: Callable[[int], None] | None = None
        """Called with `served_version` whenever it changes, from a push or a recovery alike. The
        learner hands it to its version announcements (`VersionPublisher.set_served`): an actor held
        back by its staleness bound sends no groups, so an announcement that waited for the next
        step would never come."""
        self.reports: list[PushReport] = []

    async def probe(self) -> None:
        """Ask every server which version it serves (concurrently); a server that does not answer is marked down."""
        self._follow()
        answers = await asyncio.gather(*(self._query_version(url) for url in self.server_urls))
        for url, version in zip(self.server_urls, answers, strict=True):
            if version is not None:
                self.down.pop(url, None)
                self.versions[url] = version
        self._update_served()
        self._ensure_watcher()

    async def publish(self, version: int, snapshot: dict[str, torch.Tensor]) -> float:
        """Start pushing `snapshot` as `version`; returns the seconds spent waiting for the previous push."""
        t0 = time.perf_counter()
        await self.wait()
        stall_s = time.perf_counter() - t0
        self._follow()  # no push in flight: a server that moved is pushed at its new URL (the watch may never find the publisher idle)
        self._task = asyncio.create_task(self._push(version, snapshot), name=f"weight-push-v{version}")
        self._ensure_watcher()
        return stall_s

    async def _push(self, version: int, snapshot: dict[str, torch.Tensor]) -> PushReport:
        from agentrl.common.weights import write_weights

        t0 = time.perf_counter()
        self._num_pushes += 1
        recompute_kv = self._num_pushes % self.kv_refresh_every == 0
        if not self.down and self._latest is not None:  # nobody waits for the previous file: one in shared memory
            self._latest[1].unlink(missing_ok=True)
            self._latest = None
        path = await asyncio.to_thread(write_weights, snapshot, None, self.metadata)
        write_s = time.perf_counter() - t0
        self._set_latest(version, path)
        down = list(self.down)
        answering = await asyncio.gather(*(self._query_version(url) for url in down))
        targets = [url for url in self.server_urls if url not in self.down
                   or answering[down.index(url)] is not None]
        results = await asyncio.gather(*(self._push_one(url, path, version, recompute_kv or url in down)
                                         for url in targets))
        report = PushReport(
            version=version, total_s=time.perf_counter() - t0, write_s=write_s,
            per_server={url: {"pause_s": r.pause_s, "reload_s": r.reload_s, "stage_s": r.stage_s, "transport": r.transport,
                              "bytes": r.bytes, "upload_s": r.upload_s}
                        for url, r in zip(targets, results, strict=True) if r is not None},
            failed={url: self.down[url] for url in self.server_urls if url in self.down},
        )
        self.num_recoveries += sum(url in down and url not in self.down for url in targets)
        self._update_served()
        self.reports.append(report)
        return report

    async def _recover(self) -> None:
        """Push the latest weights to the down servers that answer again, and to the servers that
        serve less than they were pushed (restarted)."""
        assert self._latest is not None
        version, path = self._latest
        up = [url for url in self.server_urls if url not in self.down]
        # A server that is up and busy (an evaluation beside the actor on a CPU) may not answer a
        # version query in time: that is not a restart, and it stays up; only a lower version is one.
        answers = await asyncio.gather(*(self._query_version(url, mark_down=False) for url in up))
        for url, served in zip(up, answers, strict=True):
            if served is not None and served < self.versions.get(url, served):
                self._mark_down(url, f"serves version {served}, below the {self.versions[url]} it was pushed: it restarted")
        down = list(self.down)
        answering = await asyncio.gather(*(self._query_version(url) for url in down))
        for url, served in zip(down, answering, strict=True):
            if served is not None and served == version:  # it has the latest weights (a timed-out query): no push
                self.down.pop(url, None)
                self.versions[url] = served
        back = [url for url, v in zip(down, answering, strict=True) if v is not None and v != version]
        if back:
            log.warning("weight publisher: %s answer again; pushing them version %d", back, version)
            await asyncio.gather(*(self._push_one(url, path, version, True) for url in back))
            self.num_recoveries += sum(url not in self.down for url in back)
        self._update_served()

    async def _push_one(self, url: str, path: Path, version: int, recompute_kv: bool):
        from agentrl.common.weights import WeightPushError, push_weights

        try:
            result = await push_weights(url, path, version, timeout_s=self.push_timeout_s, recompute_kv=recompute_kv,
                                        transport=self.transport)
        except (WeightPushError, TimeoutError) as err:
            self._mark_down(url, f"push of version {version} failed: {type(err).__name__}: {err}")
            return None
        self.down.pop(url, None)
        self.versions[url] = version
        return result

    async def _query_version(self, url: str, *, mark_down: bool = True) -> int | None:
        """The version `url` serves, or None (and the server is marked down, if `mark_down`) if it does not answer."""
        from agentrl.common.inference import InferenceServerError, VLLMClient

        try:
            async with asyncio.timeout(self.probe_timeout_s), VLLMClient(url, connect_timeout_s=self.probe_timeout_s) as client:
                return await client.weight_version()
        except (InferenceServerError, TimeoutError) as err:
            if mark_down and url not in self.down:
                self._mark_down(url, f"version query failed: {type(err).__name__}: {err}")
            return None

    def move(self, old_url: str, new_url: str) -> None:
        """The server at `old_url` answers at `new_url` now: it is down there until it answers, then
        pushed the latest weights (it started with the base ones)."""
        index = self.server_urls.index(old_url)
        self.server_urls[index] = new_url
        self.versions.pop(old_url, None)
        self.down.pop(old_url, None)
        self.num_push_failures[new_url] = self.num_push_failures.pop(old_url, 0)
        self.down[new_url] = f"it moved from {old_url}; not pushed there yet"  # not a failed push: not counted
        log.warning("weight publisher: server %s answers at %s now; it is pushed the latest weights when it answers",
                    old_url, new_url)
        self._update_served()

    def _follow(self) -> None:
        if self.directory is None:
            return
        for move in self.directory.moves():
            if move.key == INFERENCE:
                self.move(move.old, move.new)

    def _mark_down(self, url: str, why: str) -> None:
        if url not in self.down:
            log.error("weight publisher: server %s is down (%s); the others keep getting weights, and it is "
                      "pushed the latest ones when it answers again", url, why)
        self.num_push_failures[url] = self.num_push_failures.get(url, 0) + 1
        self.down[url] = why
        self.versions.pop(url, None)

    def _set_latest(self, version: int, path: Path) -> None:
        if self._latest is not None:
            self._latest[1].unlink(missing_ok=True)
        self._latest = (version, path)

    def _update_served(self) -> None:
        if not self.versions:  # none up: keep the last value (nothing serves anything newer)
            return
        served, self.served_version = self.served_version, min(self.versions.values())
        if self.served_version != served and self.on_served is not None:
            self.on_served(self.served_version)

    def _ensure_watcher(self) -> None:
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._watch_down(), name="weight-publisher-recovery")

    async def _watch_down(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            idle = self._task is None or (self._task.done() and not self._task.cancelled()
                                          and self._task.exception() is None)
            if idle:
                try:
                    self._follow()
                except ValueError as err:  # a URL the directory moved that this publisher never had
                    log.error("weight publisher: the service directory names a move it cannot follow: %s", err)
            if self._latest is not None and idle:
                self._task = asyncio.create_task(self._recover(), name="weight-push-recovery")

    async def wait(self) -> PushReport | None:
        """Wait for the push in flight (if any); re-raises its failure (a failure of this side, such
        as the weights file write; a server's failure only marks it down). The task stays `_task`
        until it is done, so that the recovery watch never starts a push beside it."""
        task = self._task
        if task is None:
            return None
        try:
            return await task
        finally:
            if self._task is task:
                self._task = None

    async def close(self, timeout_s: float = 60.0) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.wait({self._watcher}, timeout=timeout_s)
            self._watcher = None
        try:
            if self._task is not None:
                await asyncio.wait_for(self.wait(), timeout_s)
        finally:
            if self._latest is not None:
                self._latest[1].unlink(missing_ok=True)
                self._latest = None
