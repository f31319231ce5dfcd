"""Async client for one tool service hosted by one or more replicas.

Public API (the engine and the training supervisor code against exactly these names):

    client = ToolClient(["tcp://127.0.0.1:5601", "tcp://127.0.0.1:5602"], request_timeout_s=30.0)
    async with client:                       # or: await client.start(); ...; await client.close()
        specs = await client.describe()      # [{"type": "function", "function": {...}, "idempotent": bool}]
        resp = await client.call("search", {"query": "who founded X", "top_k": 3}, deadline_s=10.0)
        if resp.ok: use(resp.content)
        else:       observe(resp.error.type, resp.error.message)

- `ToolResponse(ok, content, error, server_latency_s, replica)`: one per call. A service-side
  failure (bad arguments, a limit hit in the sandbox, an expression that divides by zero, a
  deadline that passed) is a ToolResponse with ok=False and a `ToolError(type, message)`, never an
  exception: the agent observes it like any tool result. `type` is one of protocol.E_*.
- `ToolServiceUnavailable` is raised when the call cannot be delivered: no live replica, or the
  replica running a non-idempotent call died (the call may or may not have run, so it is not
  resent).
- `deadline_s` is the call's time budget in seconds from now (default `request_timeout_s`). The
  server answers `deadline_exceeded` when it cannot finish in time; if no reply at all arrives
  within the budget plus `reply_grace_s` (checked every `heartbeat_interval_s`), the call returns
  ok=False, error type `deadline_exceeded`, `server_latency_s` = 0.

How replicas are used:
- Each replica gets its own DEALER socket, so a reply is always matched against the requests sent
  to that replica. A call goes to the live replica with the fewest calls in flight.
- Liveness: every `heartbeat_interval_s` each replica is pinged; any reply refreshes it. A replica
  is declared dead when nothing came back for `heartbeat_interval_s * heartbeat_misses` (replies
  already waiting in the socket count), or at once when its TCP connection drops (socket monitor
  event, e.g. after SIGKILL).
- On death the replica's socket is closed with linger 0 (so requests still queued in it are never
  delivered to a later process at that endpoint) and its in-flight calls are resent to a live
  replica if the tool is idempotent (from `describe`); otherwise they raise ToolServiceUnavailable.
  The dead replica is probed with a fresh socket each heartbeat and rejoins when it answers.
- Exactly once to the caller: a call's future is resolved once; a reply whose id is no longer
  pending at that replica (it was resent elsewhere and answered there) is dropped and counted in
  `stats["num_late_replies_dropped"]`.
- `overloaded` / `shutting_down` replies mean the call was not executed; it is resent (to another
  replica when one is live) with a short backoff until its deadline, for every tool.

Backpressure: at most `max_in_flight` calls are outstanding per client; further `call()`s wait.
DEALER sends await when the per-replica ZeroMQ queue (`sndhwm`) is full.

Sizes (see protocol.py): the requests queued in one event-loop turn leave in frames of at most
`max_request_bytes` (one request larger than that is answered `request_too_large` here, not sent,
so that no frame can exceed the server's limit and cost this client its connection); the DEALER's
MAXMSGSIZE is `max_reply_bytes`. A reply that does not decode, or is not a reply map, is counted in
`stats["num_bad_replies"]`, logged and dropped; the call it was for gets `deadline_exceeded` when
its budget runs out.

Shutdown: `close()` cancels the heartbeat, readers and monitors it owns, fails calls still pending
with ToolServiceUnavailable("client closed"), and closes every socket with linger 0: bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from agentrl.common.curve import ClientKeys, curve_client, is_local_endpoint
from agentrl.toolservers import protocol as P
from agentrl.toolservers.protocol import ToolError

__all__ = ["ToolClient", "ToolError", "ToolResponse", "ToolServiceUnavailable"]

log = logging.getLogger(__name__)


class ToolServiceUnavailable(RuntimeError):
    """The call could not be delivered to (or its result recovered from) any replica."""


@dataclass(slots=True)
class ToolResponse:
    ok: bool
    content: Any
    error: ToolError | None
    server_latency_s: float
    """Seconds the server spent from receiving the call to sending the reply."""
    replica: str
    """Endpoint of the replica that answered."""


class _Pending:
    """One call from first send to resolution (it keeps its future across resends)."""

    __slots__ = ("req_id", "payload_fields", "retry_on_death", "budget_s", "deadline_s", "future", "replica")

    def __init__(self, payload_fields: dict, retry_on_death: bool, budget_s: float, deadline_s: float,
                 future: asyncio.Future):
        self.req_id = 0
        self.payload_fields = payload_fields
        self.retry_on_death = retry_on_death
        self.budget_s = budget_s
        self.deadline_s = deadline_s  # loop.time() after which the caller no longer waits
        self.future = future
        self.replica: _Replica | None = None


class _Replica:
    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.sock: zmq.asyncio.Socket | None = None
        self.tasks: list[asyncio.Task] = []
        self.alive = False
        self.last_seen_s = -math.inf
        self.pending: dict[int, _Pending] = {}
        self.outbox: list[bytes] = []  # packed requests waiting for the next flush
        self.send_future: asyncio.Future | None = None


class ToolClient:
    def __init__(
        self,
        endpoints: list[str],
        *,
        request_timeout_s: float = 30.0,
        heartbeat_interval_s: float = 1.0,
        heartbeat_misses: int = 5,
        reply_grace_s: float = 2.0,
        max_in_flight: int = 4096,
        sndhwm: int = 10_000,
        max_request_bytes: int = 1 << 20,
        max_reply_bytes: int = 64 << 20,
        curve_server_public_key: bytes | None = None,
        curve_client_public_key: bytes | None = None,
        curve_client_secret_key: bytes | None = None,
    ):
        """
        endpoints: the replicas of ONE service (same tools), e.g. ["tcp://127.0.0.1:5601"].
        request_timeout_s: default call budget, and how long start() waits for a first replica.
        heartbeat_interval_s: seconds between pings to each replica.
        heartbeat_misses: silent intervals after which a replica is declared dead (5 s in all by
            default: a crash is seen at once from the dropped connection; silence is for a hung
            replica, and must not fire on a loaded host).
        reply_grace_s: seconds past a call's deadline the client still waits for the server's reply.
        max_in_flight: calls outstanding at once from this client; more call()s wait.
        sndhwm: per-replica ZeroMQ send queue, in messages.
        max_request_bytes: largest request frame sent, in bytes (the server's max_request_bytes
            by default); batches are split under it, a single larger request is refused here.
        max_reply_bytes: largest reply frame accepted (ZeroMQ MAXMSGSIZE), in bytes; at least the
            servers' max_reply_frame_bytes.
        curve_*: z85 CurveZMQ keys (zmq.auth.load_certificate) for a server bound off loopback.
        """
        if not endpoints:
            raise ValueError("ToolClient needs at least one endpoint")
        if request_timeout_s <= 0 or heartbeat_interval_s <= 0 or heartbeat_misses < 1:
            raise ValueError("request_timeout_s and heartbeat_interval_s must be > 0, heartbeat_misses >= 1")
        curve = (curve_server_public_key, curve_client_public_key, curve_client_secret_key)
        if any(curve) and not all(curve):
            raise ValueError("CurveZMQ needs the server public key and this client's public and secret keys")
        for endpoint in endpoints:
            is_local_endpoint(endpoint)  # raises on a malformed endpoint
        self.request_timeout_s = request_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.dead_after_s = heartbeat_interval_s * heartbeat_misses
        self.reply_grace_s = reply_grace_s
        self._curve = ClientKeys(*curve) if all(curve) else None
        self._sndhwm = sndhwm
        self._max_request_bytes = max_request_bytes
        self._max_reply_bytes = max_reply_bytes
        self._replicas = [_Replica(e) for e in dict.fromkeys(endpoints)]
        self._ids = itertools.count(1)
        self._rr = itertools.count()
        self._slots = asyncio.Semaphore(max_in_flight)
        self._ctx: zmq.asyncio.Context | None = None
        self._heartbeat: asyncio.Task | None = None
        self._idempotent: dict[str, bool] = {}
        self._specs: list[dict] | None = None
        self._any_alive: asyncio.Event | None = None
        self._ping_ids: set[int] = set()
        self._retired_tasks: list[asyncio.Task] = []
        self.stats = {"num_resent": 0, "num_late_replies_dropped": 0, "num_replica_deaths": 0,
                      "num_bad_replies": 0}

    # --- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> ToolClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect to every replica and wait (up to request_timeout_s) until one answers; learn the
        tools' idempotent flags from describe."""
        self._ctx = zmq.asyncio.Context()
        self._any_alive = asyncio.Event()
        for rep in self._replicas:
            self._open(rep)
        self._heartbeat = self._own(self._heartbeat_loop(), "toolclient-heartbeat")
        try:
            await asyncio.wait_for(self._any_alive.wait(), self.request_timeout_s)
        except TimeoutError:
            await self.close()
            raise ToolServiceUnavailable(
                f"no replica of {[r.endpoint for r in self._replicas]} answered within "
                f"{self.request_timeout_s} s; is the service started (READY printed)?"
            ) from None
        await self.describe()

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None
        for rep in self._replicas:
            for pending in rep.pending.values():
                if not pending.future.done():
                    pending.future.set_exception(ToolServiceUnavailable("client closed"))
            rep.pending.clear()
            self._close_socket(rep)
        await asyncio.gather(*self._retired_tasks, return_exceptions=True)  # failures logged by _own
        self._retired_tasks.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    # --- public calls ----------------------------------------------------------------------------

    async def describe(self) -> list[dict]:
        """Each tool's OpenAI function-calling schema plus its top-level "idempotent" flag."""
        resp = await self._request({"op": P.OP_DESCRIBE}, self.request_timeout_s, retry_on_death=True)
        if not resp.ok:
            assert resp.error is not None
            raise ToolServiceUnavailable(f"describe failed: {resp.error.type}: {resp.error.message}")
        self._specs = resp.content
        self._idempotent = {s["function"]["name"]: bool(s["idempotent"]) for s in resp.content}
        return resp.content

    async def call(self, tool: str, arguments: dict, *, deadline_s: float | None = None) -> ToolResponse:
        budget_s = self.request_timeout_s if deadline_s is None else deadline_s
        fields = {"op": P.OP_CALL, "tool": tool, "args": arguments}
        return await self._request(fields, budget_s, retry_on_death=self._idempotent.get(tool, False))

    @property
    def endpoints(self) -> list[str]:
        """Where the replicas answer (as moved by `move`)."""
        return [r.endpoint for r in self._replicas]

    def live_replicas(self) -> list[str]:
        return [r.endpoint for r in self._replicas if r.alive]

    # --- requests --------------------------------------------------------------------------------

    async def _request(self, fields: dict, budget_s: float, retry_on_death: bool) -> ToolResponse:
        if self._ctx is None:
            raise RuntimeError("ToolClient used before start() (or after close())")
        loop = asyncio.get_running_loop()
        async with self._slots:
            pending = _Pending(fields, retry_on_death, budget_s, loop.time() + budget_s, loop.create_future())
            backoff_s = 0.005
            while True:
                # A call with no reply by its deadline + reply_grace_s is answered by the heartbeat
                # loop's sweep (_expire), not by a timer per call: timers cost more than the rest
                # of a calculator call on the client side.
                await self._send(pending)
                resp = await pending.future
                if resp.ok or resp.error.type not in P.NOT_EXECUTED_ERRORS:
                    return resp
                if loop.time() + backoff_s >= pending.deadline_s:
                    return resp
                # Not executed (overloaded or stopping): safe to resend, even if not idempotent.
                self.stats["num_resent"] += 1
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 0.2)
                pending.future = loop.create_future()

    def _expire(self, pending: _Pending) -> None:
        rep = pending.replica
        endpoint = rep.endpoint if rep is not None else "?"
        if rep is not None:
            rep.pending.pop(pending.req_id, None)
        if pending.future.done():
            return
        message = f"no reply within {pending.budget_s} s (+{self.reply_grace_s} s grace) from {endpoint}"
        pending.future.set_result(ToolResponse(False, None, ToolError(P.E_DEADLINE, message), 0.0, endpoint))

    async def _send(self, pending: _Pending) -> None:
        rep = self._pick(exclude=pending.replica)
        pending.req_id = next(self._ids)
        timeout_s = pending.deadline_s - asyncio.get_running_loop().time()
        packed = P.pack({"id": pending.req_id, **pending.payload_fields, "timeout_s": timeout_s})
        if len(packed) > self._max_request_bytes:
            message = (f"request is {len(packed)} bytes; this client sends at most {self._max_request_bytes} "
                       "(max_request_bytes); not sent")
            pending.future.set_result(ToolResponse(False, None, ToolError(P.E_TOO_LARGE, message), 0.0, rep.endpoint))
            return
        pending.replica = rep
        rep.pending[pending.req_id] = pending
        self._enqueue(rep, packed)

    def _enqueue(self, rep: _Replica, packed: bytes) -> None:
        # Everything enqueued during one event-loop turn leaves as one frame (see protocol.py).
        rep.outbox.append(packed)
        if len(rep.outbox) == 1 and rep.send_future is None:
            asyncio.get_running_loop().call_soon(self._flush_outbox, rep)

    def _flush_outbox(self, rep: _Replica) -> None:
        if rep.send_future is not None or not rep.outbox or rep.sock is None:
            return
        batch = self._next_batch(rep.outbox)
        rep.outbox = rep.outbox[len(batch):]
        frame = batch[0] if len(batch) == 1 else P.pack_array(batch)
        fut = rep.sock.send(frame)
        # Done at once unless the replica's queue is at sndhwm; then the next flush waits for it,
        # and calls queue in the outbox (bounded by max_in_flight).
        rep.send_future = fut
        fut.add_done_callback(lambda f, rep=rep: self._on_sent(rep, f))

    def _next_batch(self, outbox: list[bytes]) -> list[bytes]:
        """The longest prefix of `outbox` that fits one frame of max_request_bytes (each request
        alone fits: _send checked)."""
        budget = self._max_request_bytes - 5  # the array header
        for num_items, packed in enumerate(outbox):
            budget -= len(packed)
            if budget < 0 and num_items:
                return outbox[:num_items]
        return outbox

    def _on_sent(self, rep: _Replica, fut: asyncio.Future) -> None:
        if rep.send_future is fut:
            rep.send_future = None
        if fut.cancelled():
            return
        if fut.exception() is not None:
            # Only a socket closed under us (replica declared dead); its calls were re-sent.
            log.info("send to %s failed: %s", rep.endpoint, fut.exception())
            return
        self._flush_outbox(rep)

    def _pick(self, exclude: _Replica | None) -> _Replica:
        if len(self._replicas) == 1 and self._replicas[0].alive:
            return self._replicas[0]
        alive = [r for r in self._replicas if r.alive]
        if not alive:
            raise ToolServiceUnavailable(
                f"no live replica among {[r.endpoint for r in self._replicas]} (all missed "
                f"{self.dead_after_s:.1f} s of heartbeats or dropped their connection)"
            )
        if exclude is not None and len(alive) > 1:
            alive = [r for r in alive if r is not exclude] or alive
        start = next(self._rr) % len(alive)
        rotated = alive[start:] + alive[:start]
        return min(rotated, key=lambda r: len(r.pending))

    def move(self, old_endpoint: str, new_endpoint: str) -> None:
        """The replica at `old_endpoint` answers at `new_endpoint` now (started again elsewhere): it
        is dead here until the heartbeat's probe reaches it there. Its calls in flight are resent to
        the other replicas or failed, as for any replica that dies."""
        is_local_endpoint(new_endpoint)  # raises on a malformed endpoint
        for rep in self._replicas:
            if rep.endpoint == old_endpoint:
                if rep.alive:
                    self._mark_dead(rep, f"it answers at {new_endpoint} now")
                else:
                    self._close_socket(rep)
                rep.endpoint = new_endpoint
                log.warning("replica %s now answers at %s", old_endpoint, new_endpoint)
                return
        raise KeyError(f"no replica {old_endpoint} (the replicas: {[r.endpoint for r in self._replicas]})")

    # --- per-replica sockets -----------------------------------------------------------------------

    def _open(self, rep: _Replica) -> None:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self._sndhwm)
        sock.setsockopt(zmq.RCVHWM, self._sndhwm)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_reply_bytes)
        if self._curve is not None:
            curve_client(sock, self._curve)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(rep.endpoint)
        rep.sock = sock
        rep.tasks = [
            self._own(self._read_loop(rep, sock), f"toolclient-read-{rep.endpoint}"),
            self._own(self._monitor_loop(rep, sock, monitor), f"toolclient-mon-{rep.endpoint}"),
        ]

    def _close_socket(self, rep: _Replica) -> None:
        # Synchronous so that no await can interleave a second open of the same replica.
        for task in rep.tasks:
            task.cancel()
        self._retired_tasks.extend(rep.tasks)
        rep.tasks = []
        rep.outbox = []  # never delivered: their calls are resent or failed by the caller of this
        rep.send_future = None
        if rep.sock is not None:
            rep.sock.disable_monitor()
            rep.sock.close(linger=0)
            rep.sock = None

    def _own(self, coro: Any, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(_log_task_failure)
        return task

    async def _read_loop(self, rep: _Replica, sock: zmq.asyncio.Socket) -> None:
        loop = asyncio.get_running_loop()
        # A plain socket over the same handle drains what is already queued without a future per
        # message (halves the client's cost per reply at 64 calls in flight).
        drain = zmq.Socket.shadow(sock.underlying)
        while True:
            payloads = [await sock.recv()]
            for _ in range(1024):
                try:
                    payloads.append(drain.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
            rep.last_seen_s = loop.time()
            if not rep.alive:
                rep.alive = True
                assert self._any_alive is not None
                self._any_alive.set()
                log.info("replica %s is live", rep.endpoint)
            for payload in payloads:
                self._on_payload(rep, payload)

    def _on_payload(self, rep: _Replica, payload: bytes) -> None:
        try:
            msg = P.unpack(payload)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            self._bad_reply(rep, f"a reply frame is not msgpack ({exc})")
            return
        for one in msg if isinstance(msg, list) else (msg,):
            problem = _reply_problem(one)
            if problem is None:
                self._on_reply(rep, one)
            else:
                self._bad_reply(rep, problem)

    def _bad_reply(self, rep: _Replica, problem: str) -> None:
        self.stats["num_bad_replies"] += 1
        log.warning("dropped a bad reply from %s: %s (%d so far)", rep.endpoint, problem[:200],
                    self.stats["num_bad_replies"])

    def _on_reply(self, rep: _Replica, msg: dict) -> None:
        pending = rep.pending.pop(msg["id"], None)
        if pending is None:
            if msg["id"] in self._ping_ids:
                self._ping_ids.discard(msg["id"])
            else:
                self.stats["num_late_replies_dropped"] += 1
            return
        err = msg["error"]
        resp = ToolResponse(
            msg["ok"], msg["content"], ToolError(err["type"], err["message"]) if err else None,
            msg["latency_s"], rep.endpoint,
        )
        if not pending.future.done():
            pending.future.set_result(resp)

    async def _monitor_loop(self, rep: _Replica, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED and rep.sock is sock and rep.alive:
                    # Scheduled, not awaited: _mark_dead cancels this very task.
                    asyncio.get_running_loop().call_soon(self._mark_dead, rep, "connection dropped")
        finally:
            monitor.close(linger=0)

    # --- liveness --------------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        loop = asyncio.get_running_loop()
        last_tick = loop.time()
        while True:
            now = loop.time()
            # Time this process could not run (its event loop blocked: the pings it meant to send
            # sat unsent) is not the replica's silence: it is excused. Seen in a fuzz run with 64
            # episodes on 2 loaded cores: 2 s loop stalls, and a live calculator declared dead.
            stall_s = now - last_tick - self.heartbeat_interval_s
            last_tick = now
            if stall_s > 0:
                for rep in self._replicas:
                    rep.last_seen_s += stall_s
            for rep in self._replicas:
                for pending in [p for p in rep.pending.values() if now > p.deadline_s + self.reply_grace_s]:
                    self._expire(pending)
                if rep.alive and now - rep.last_seen_s > self.dead_after_s and not self._drain(rep):
                    self._mark_dead(rep, f"silent for {now - rep.last_seen_s:.1f} s")
                if not rep.alive:
                    # A fresh probe socket each time: pings queued to a dead endpoint are dropped
                    # rather than piling up, and nothing stale reaches a process that comes back.
                    self._close_socket(rep)
                    self._open(rep)
                ping_id = next(self._ids)
                self._ping_ids.add(ping_id)
                self._enqueue(rep, P.pack({"id": ping_id, "op": P.OP_PING}))
            self._retired_tasks = [t for t in self._retired_tasks if not t.done()]
            if len(self._ping_ids) > 100_000:
                self._ping_ids.clear()  # pings to replicas that died unanswered; bounded memory
            await asyncio.sleep(self.heartbeat_interval_s)

    def _drain(self, rep: _Replica) -> int:
        """Handle replies already queued in the socket, down to empty (so no wake-up is lost for
        the reader), and return how many there were. Used before declaring a replica dead: on a
        loaded host (load average 18 on 2 cores) this process went 2.4 s between reads while the
        replica's answers sat in the socket."""
        if rep.sock is None:
            return 0
        drain = zmq.Socket.shadow(rep.sock.underlying)
        num_frames = 0
        while True:
            try:
                payload = drain.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            num_frames += 1
            self._on_payload(rep, payload)
        if num_frames:
            rep.last_seen_s = asyncio.get_running_loop().time()
        return num_frames

    def _mark_dead(self, rep: _Replica, reason: str) -> None:
        if not rep.alive:
            return
        rep.alive = False
        self.stats["num_replica_deaths"] += 1
        # Replies that arrived before the connection dropped (e.g. the answers a stopping server
        # flushed) are delivered, not resent: the monitor event can overtake the reader.
        self._drain(rep)
        orphans = list(rep.pending.values())
        rep.pending.clear()
        log.warning("replica %s declared dead (%s); %d calls in flight there", rep.endpoint, reason, len(orphans))
        if not any(r.alive for r in self._replicas):
            assert self._any_alive is not None
            self._any_alive.clear()
        # Close now (linger 0) so that nothing still queued for the dead replica is delivered later;
        # the heartbeat loop probes it with a fresh socket.
        self._close_socket(rep)
        for pending in orphans:
            if pending.future.done():
                continue
            if not pending.retry_on_death:
                tool = pending.payload_fields.get("tool")
                pending.future.set_exception(ToolServiceUnavailable(
                    f"replica {rep.endpoint} died ({reason}) during a call to {tool!r}, which is not "
                    "idempotent: it may or may not have run, so it is not resent"
                ))
                continue
            self.stats["num_resent"] += 1
            self._retired_tasks.append(self._own(self._resend(pending), "toolclient-resend"))

    async def _resend(self, pending: _Pending) -> None:
        try:
            await self._send(pending)
        except ToolServiceUnavailable as exc:
            if not pending.future.done():
                pending.future.set_exception(exc)


def _reply_problem(msg: Any) -> str | None:
    """None if `msg` is a reply map as protocol.py defines it, else what is wrong with it."""
    if not isinstance(msg, dict):
        return f"a reply is {type(msg).__name__}, not a map"
    req_id, err, latency_s = msg.get("id"), msg.get("error"), msg.get("latency_s")
    if req_id is not None and (not isinstance(req_id, int) or isinstance(req_id, bool)):
        return f"reply id {P.short_repr(req_id)} is not an integer"
    if not isinstance(msg.get("ok"), bool) or "content" not in msg:
        return "a reply lacks a boolean 'ok' or a 'content'"
    if not isinstance(latency_s, int | float) or isinstance(latency_s, bool):
        return "a reply lacks a numeric 'latency_s'"
    if msg["ok"] == (err is not None):
        return "a reply's 'ok' disagrees with its 'error'"
    if err is not None and not (isinstance(err, dict) and isinstance(err.get("type"), str)
                                and isinstance(err.get("message"), str)):
        return "a reply's 'error' is not {type: str, message: str}"
    return None


def _log_task_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s failed", task.get_name(), exc_info=task.exception())
