"""The tool-service framework: one ROUTER socket, one loop thread, tools that run inline or in pools.

Lifecycle: `ToolServer(config, tools).serve()` binds, starts every tool (the python tool pre-starts
its sandboxes here), prints `READY <endpoint>` on stdout once requests are accepted, and loops
until SIGTERM/SIGINT (or `stop()`). Shutdown is bounded: queued calls are answered
`shutting_down` (not executed, so safe to resend anywhere), running calls get
`ServerConfig.shutdown_grace_s` to finish (those still running then are answered with an error
and their workers killed), tools are closed, and the socket closes with a
`linger_ms` bound so that unsent replies cannot hang the exit (ZeroMQ's default linger is
forever).

The loop: poll the ROUTER and the tools' result fds; drain up to `read_batch` requests without
blocking, answer `ping`/`describe`/bad input at once, group valid calls by tool and hand each group
to its tool (`submit`), which finishes them inline (calculator, search: batched) or queues them
for its workers (python). Finished calls become replies.

Backpressure, and why nothing is dropped silently:
- At most `max_in_flight` calls are accepted (accepted = received and not yet handed to ZeroMQ as
  a reply). A call beyond that is answered at once with `overloaded`, which says it was NOT
  executed, so the client may resend it. Pings and describes are answered whatever the load of
  calls, so a busy replica still looks alive to its clients' heartbeats.
- Replies are sent with ROUTER_MANDATORY and NOBLOCK, per peer, in frames of at most
  `max_reply_frame_bytes`. A peer whose ZeroMQ queue is full (`sndhwm` frames unread: it is not
  reading) is *stalled*: its replies wait in the server's queue for it, its new calls are answered
  `overloaded` (not executed) instead of run, and if what waits for it passes
  `max_held_reply_bytes` those replies are dropped (counted in `num_replies_dropped_stalled`,
  logged). Every other peer is served as before: one peer that stops reading cannot stall the
  replies of the others, and the memory it can pin is bounded (ZeroMQ's queue: sndhwm frames;
  the server's: max_held_reply_bytes).
- A reply to a peer that has disconnected cannot be delivered by anyone; it is counted in
  `num_replies_unroutable` and logged.

Hostile input: the ROUTER's MAXMSGSIZE is `max_frame_bytes`, so a larger frame never reaches
memory (ZeroMQ drops that connection). Frames are decoded as untrusted msgpack; anything that is not
a well-formed request is answered with a structured error naming the problem (with the request's id
where one can be read), and a request element over `max_request_bytes` gets `request_too_large`
with its id, so none of a batch's calls waits out its deadline for nothing.
"""

from __future__ import annotations

import collections
import logging
import math
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from agentrl.common.config import config_dataclass
from agentrl.common.curve import (
    ServerKeys,
    curve_server,
    load_server_keys,
    require_curve_off_loopback,
    stop_authenticator,
)
from agentrl.toolservers import protocol as P

log = logging.getLogger(__name__)


@config_dataclass
class ServerConfig:
    """How one tool service listens and bounds its work (`[server]` of `agentrl toolserver --config`)."""

    bind: str = "tcp://127.0.0.1:5555"
    """ZeroMQ endpoint to bind. Loopback by default; anything else needs the two curve_* fields."""
    max_request_bytes: int = 1 << 20
    """Largest request accepted (one element of a batch), in bytes; a larger one is answered
    `request_too_large` with its id."""
    max_frame_bytes: int = 4 << 20
    """Largest request frame read, in bytes (ZeroMQ MAXMSGSIZE): a peer that sends a larger one is
    disconnected by ZeroMQ before the frame is buffered."""
    max_reply_frame_bytes: int = 4 << 20
    """Largest reply frame sent, in bytes: a peer's replies are batched under it, and one reply larger
    than it is replaced by `reply_too_large`. Clients' max_reply_bytes must be at least this."""
    max_in_flight: int = 4096
    """Calls accepted and not yet replied to; beyond it calls get `overloaded` (not executed)."""
    read_batch: int = 256
    """Frames drained per loop turn before working: amortizes polling and lets search batch."""
    reply_batch: int = 16
    """Replies are sent after every this many finished inline calls rather than once per loop
    turn, so a client works on the first replies while the server computes the rest: with one
    flush per 64-call batch, client and server took turns instead of overlapping."""
    sndhwm: int = 1000
    """Per-peer reply queue in ZeroMQ, in frames (each at most max_reply_frame_bytes). Behind it are
    the peer's TCP buffers and its own receive queue (10,000 frames for ToolClient), so only a
    client that stops reading fills it; that peer is then stalled (see the module docstring)."""
    max_held_reply_bytes: int = 64 << 20
    """Replies held by the server for one stalled peer, in bytes; past it they are dropped."""
    linger_ms: int = 500
    """How long close() may spend delivering replies already queued, in milliseconds."""
    shutdown_grace_s: float = 2.0
    """How long running calls may take to finish after SIGTERM before their workers are killed."""
    curve_secret_key_file: str | None = None
    """zmq.auth secret certificate (`NAME.key_secret`) of this server; required off loopback."""
    curve_authorized_clients_dir: str | None = None
    """Directory of zmq.auth public certificates (`*.key`) of the clients allowed to connect."""

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_in_flight", "read_batch", "reply_batch", "sndhwm"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.max_frame_bytes < self.max_request_bytes:
            raise ValueError(f"max_frame_bytes: {self.max_frame_bytes} must be >= max_request_bytes "
                             f"({self.max_request_bytes}): a frame holds at least one request")
        if self.max_reply_frame_bytes < 64 << 10:
            raise ValueError("max_reply_frame_bytes: must be >= 65536 (an error reply must always fit)")
        if self.max_held_reply_bytes < self.max_reply_frame_bytes:
            raise ValueError("max_held_reply_bytes: must be >= max_reply_frame_bytes")
        if self.linger_ms < 0 or self.shutdown_grace_s < 0:
            raise ValueError("linger_ms: linger_ms and shutdown_grace_s must be >= 0")

    def check_host(self) -> None:
        """What only this host can tell: the CurveZMQ key files exist and hold keys, and a bind off
        loopback has them (ValueError naming the option)."""
        require_curve_off_loopback(
            self.bind, self.curve_keys(), key="--bind", why="tool services run code and read data on request",
            how="pass --curve-secret-key keys/server.key_secret --curve-authorized-clients DIR_WITH_CLIENT_KEYS")

    def curve_keys(self) -> ServerKeys | None:
        """The CurveZMQ keys, read and checked (ValueError naming the option); None without keys."""
        return load_server_keys(self.curve_secret_key_file, self.curve_authorized_clients_dir,
                                names=("--curve-secret-key", "--curve-authorized-clients"))


@dataclass(frozen=True)
class ToolSpec:
    """What a tool tells its callers: OpenAI function-calling schema plus the idempotent flag."""

    name: str
    description: str
    parameters: dict
    """JSON Schema of the arguments object (checked on every call)."""
    idempotent: bool
    """True if running a call twice is harmless, so a client may resend it when a replica dies."""

    def __post_init__(self) -> None:
        P.check_schema_supported(self.parameters, f"tool {self.name!r} parameters")
        if self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema of type object")

    def describe(self) -> dict:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
            "idempotent": self.idempotent,
        }


@dataclass(slots=True)
class Job:
    """One accepted call, from receipt to reply."""

    peer: bytes
    req_id: int
    args: dict
    received_s: float
    """time.monotonic() at receipt."""
    deadline_s: float
    """time.monotonic() after which the caller no longer wants the result."""


@dataclass(slots=True)
class Outcome:
    ok: bool
    content: Any = None
    error: P.ToolError | None = None

    @staticmethod
    def failure(err_type: str, message: str) -> Outcome:
        return Outcome(False, None, P.ToolError(err_type, message))


class ToolFailure(Exception):
    """Raised by an inline tool for a failure of the call itself (bad expression, ...)."""


def _internal_error(tool: str, exc: Exception) -> str:
    return f"internal error in tool {tool}: {type(exc).__name__}: {str(exc)[:500]}"


class Tool:
    """A tool hosted by a ToolServer. Inline tools override `run`; pooled tools override `submit`,
    `fds`, `on_readable`, `tick` (all called from the server's loop thread only)."""

    spec: ToolSpec

    def start(self) -> None:
        pass

    def run(self, args: dict) -> Any:
        raise NotImplementedError

    def run_batch(self, jobs: list[Job]) -> list[Outcome]:
        """Each call once: an unexpected exception from `run` is logged with its traceback and
        answered as `tool_error` to that call alone (no retry of the batch, which would run
        every call of it a second time)."""
        outcomes = []
        for job in jobs:
            try:
                outcomes.append(Outcome(True, self.run(job.args)))
            except ToolFailure as exc:
                outcomes.append(Outcome.failure(P.E_TOOL, str(exc)))
            except Exception as exc:  # noqa: BLE001  logged here, and answered to this caller
                log.exception("tool %s failed on call %d", self.spec.name, job.req_id)
                outcomes.append(Outcome.failure(P.E_TOOL, _internal_error(self.spec.name, exc)))
        return outcomes

    def submit(self, jobs: list[Job]) -> list[tuple[Job, Outcome]]:
        """Take accepted jobs; return those finished now (inline tools finish all of them).

        An unexpected exception from the tool's code on some input is logged with its traceback
        and answered as `tool_error` to the calls it hit (each call of the batch is retried alone
        to find them), so one request cannot take the service down for every other client."""
        try:
            return list(zip(jobs, self.run_batch(jobs), strict=True))
        except Exception:  # noqa: BLE001  logged below and reported to the callers it affected
            log.exception("tool %s failed on a batch of %d calls; retrying them one by one", self.spec.name, len(jobs))
        done = []
        for job in jobs:
            try:
                done.append((job, self.run_batch([job])[0]))
            except Exception as exc:  # noqa: BLE001  same: logged, and answered to this caller
                log.exception("tool %s failed on call %d", self.spec.name, job.req_id)
                done.append((job, Outcome.failure(P.E_TOOL, _internal_error(self.spec.name, exc))))
        return done

    def fds(self) -> list[int]:
        """File descriptors to poll for finished jobs."""
        return []

    def on_readable(self, fd: int) -> list[tuple[Job, Outcome]]:
        return []

    def tick(self, now_s: float) -> list[tuple[Job, Outcome]]:
        """Called every loop turn (at least every 50 ms): expire deadlines, restart workers."""
        return []

    def cancel_queued(self) -> list[Job]:
        """On shutdown: remove and return jobs not yet started."""
        return []

    def num_running(self) -> int:
        return 0

    def abort_running(self) -> list[tuple[Job, Outcome]]:
        """On shutdown, after the grace period: the calls still running, answered as failed."""
        return []

    def close(self, timeout_s: float) -> None:
        pass


@dataclass
class ServerStats:
    num_requests: int = 0
    num_calls_ok: int = 0
    num_errors: dict[str, int] = field(default_factory=collections.Counter)
    num_replies_unroutable: int = 0
    num_replies_dropped_stalled: int = 0
    num_frames_failed: int = 0
    """Frames whose handling raised (a bug: logged with its traceback, answered malformed_request)."""


@dataclass(slots=True)
class _PeerQueue:
    """Replies waiting to be handed to ZeroMQ for one peer."""

    replies: list[tuple[bytes, bool]] = field(default_factory=list)
    """(packed reply, whether it counts toward max_in_flight)"""
    num_bytes: int = 0
    stalled: bool = False
    """Its last send met a full ZeroMQ queue: the peer is not reading."""


class ToolServer:
    def __init__(self, config: ServerConfig, tools: list[Tool]):
        config.check_host()
        self.config = config
        self.tools = {t.spec.name: t for t in tools}
        if len(self.tools) != len(tools):
            raise ValueError("two tools share a name")
        self.stats = ServerStats()
        self._stop = False
        self._draining = False
        self._num_in_flight = 0
        # Replies for each peer, sent at the end of each loop turn (one frame per peer and turn when
        # they fit max_reply_frame_bytes); only stalled peers' replies are left after a flush.
        self._outbound: dict[bytes, _PeerQueue] = {}
        self._describe = [t.spec.describe() for t in tools]

    def stop(self) -> None:
        self._stop = True

    # --- lifecycle -------------------------------------------------------------------------------

    def serve(self, install_signal_handlers: bool = True) -> None:
        if install_signal_handlers:
            signal.signal(signal.SIGTERM, lambda *_: self.stop())
            signal.signal(signal.SIGINT, lambda *_: self.stop())
        ctx = zmq.Context()
        auth = None
        sock = ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, self.config.linger_ms)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.SNDHWM, self.config.sndhwm)
            sock.setsockopt(zmq.RCVHWM, self.config.sndhwm)
            sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_frame_bytes)
            keys = self.config.curve_keys()
            if keys is not None:
                auth = curve_server(ctx, sock, keys)
            sock.bind(self.config.bind)
            for tool in self.tools.values():
                tool.start()
            endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            print(f"READY {endpoint}", flush=True)
            log.info("serving %s on %s", sorted(self.tools), endpoint)
            self._loop(sock)
            self._shutdown(sock)
        finally:
            for tool in self.tools.values():
                tool.close(self.config.shutdown_grace_s)
            sock.close(linger=self.config.linger_ms)
            stop_authenticator(auth)  # after the socket: no handshake may meet it without its ZAP handler
            ctx.term()

    def _loop(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        fd_owner: dict[int, Tool] = {}
        while not self._stop:
            # Replies held for stalled peers: retry sending them every 2 ms (ZeroMQ tells no one
            # when a peer's queue drains).
            fd_owner = self._poll_once(sock, poller, fd_owner, 2 if self._outbound else 50)

    def _poll_once(self, sock: zmq.Socket, poller: zmq.Poller, fd_owner: dict[int, Tool],
                   timeout_ms: int) -> dict[int, Tool]:
        """One turn of the server: wait up to `timeout_ms` for requests and the tools' descriptors,
        handle what arrived, let each tool move its running jobs on, send what can be sent."""
        fd_owner = self._sync_fds(poller, fd_owner)
        for target, _ in poller.poll(timeout_ms):
            if target is sock:
                self._read_requests(sock)
            else:
                self._finish(fd_owner[target].on_readable(target))
        now = time.monotonic()
        for tool in self.tools.values():
            self._finish(tool.tick(now))
        self._flush(sock)
        return fd_owner

    def _shutdown(self, sock: zmq.Socket) -> None:
        for tool in self.tools.values():
            for job in tool.cancel_queued():
                self._finish([(job, Outcome.failure(P.E_SHUTTING_DOWN, "server is stopping; not executed"))])
        # Draining: keep answering pings (so clients do not declare this replica dead while its
        # last calls finish) and answer new calls `shutting_down`.
        self._draining = True
        end = time.monotonic() + self.config.shutdown_grace_s
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        fd_owner: dict[int, Tool] = {}
        while time.monotonic() < end and any(t.num_running() for t in self.tools.values()):
            fd_owner = self._poll_once(sock, poller, fd_owner, 20)
        for tool in self.tools.values():
            self._finish(tool.abort_running())
        self._flush(sock)
        if self._outbound:
            log.warning("shutdown: %d replies to %d peers could not be sent (clients not reading)",
                        sum(len(q.replies) for q in self._outbound.values()), len(self._outbound))

    def _sync_fds(self, poller: zmq.Poller, fd_owner: dict[int, Tool]) -> dict[int, Tool]:
        # A pooled tool's fds change when it restarts a worker, so re-read them each turn.
        current = {fd: tool for tool in self.tools.values() for fd in tool.fds()}
        for fd in fd_owner.keys() - current.keys():
            poller.unregister(fd)
        for fd in current.keys() - fd_owner.keys():
            poller.register(fd, zmq.POLLIN)
        return current

    # --- requests --------------------------------------------------------------------------------

    def _read_requests(self, sock: zmq.Socket) -> None:
        calls: dict[str, list[Job]] = collections.defaultdict(list)
        for _ in range(self.config.read_batch):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                admitted = self._admit(frames, time.monotonic())
            except Exception:  # noqa: BLE001  logged with its traceback and answered; the loop serves on
                self.stats.num_frames_failed += 1
                log.exception("handling a frame from peer %s failed", frames[0].hex()[:32])
                self._reject(frames[0], None, P.E_MALFORMED, "the server failed on this frame (logged there)")
                continue
            for tool_name, job in admitted:
                pending = calls[tool_name]
                pending.append(job)
                if len(pending) >= self.config.reply_batch:
                    self._finish(self.tools[tool_name].submit(pending))
                    calls[tool_name] = []
                    self._flush(sock)
        for tool_name, jobs in calls.items():
            if jobs:
                self._finish(self.tools[tool_name].submit(jobs))

    def _admit(self, frames: list[bytes], now: float) -> list[tuple[str, Job]]:
        """Answer what can be answered at once; return (tool, job) for each call to run."""
        peer = frames[0]
        if len(frames) != 2:
            self._reject(peer, None, P.E_BAD_FRAMES, f"expected 1 payload frame, got {len(frames) - 1}")
            return []
        payload = frames[1]
        try:
            elements = self._decode(payload)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            self._reject(peer, None, P.E_MALFORMED, f"payload is not valid msgpack: {P.short_repr(str(exc), 200)}")
            return []
        self.stats.num_requests += len(elements)
        calls = []
        for msg, num_bytes in elements:
            if num_bytes > self.config.max_request_bytes:
                self._reject(
                    peer, _request_id(msg), P.E_TOO_LARGE,
                    f"request is {num_bytes} bytes; this server accepts at most {self.config.max_request_bytes}",
                )
                continue
            call = self._admit_one(peer, msg, now)
            if call is not None:
                calls.append(call)
        return calls

    def _decode(self, payload: bytes) -> list[tuple[Any, int]]:
        """The payload's requests with their sizes in bytes (0: known to be within the limit)."""
        if len(payload) <= self.config.max_request_bytes:  # the common case: nothing to measure
            decoded = P.unpack(payload)
            return [(msg, 0) for msg in decoded] if isinstance(decoded, list) else [(decoded, 0)]
        return P.unpack_sized(payload)

    def _admit_one(self, peer: bytes, msg: Any, now: float) -> tuple[str, Job] | None:
        req_id = _request_id(msg)
        if req_id is None:
            return self._reject(peer, None, P.E_MALFORMED, "request must be a map with an integer 'id'")
        op = msg.get("op")
        if op == P.OP_PING:
            self._send_later(peer, P.reply(req_id, {"in_flight": self._num_in_flight}, 0.0))
            return None
        if op == P.OP_DESCRIBE:
            self._send_later(peer, P.reply(req_id, self._describe, 0.0))
            return None
        if op != P.OP_CALL:
            return self._reject(peer, req_id, P.E_UNKNOWN_OP,
                                f"op must be call, describe or ping; got {P.short_repr(op)}")
        tool_name = msg.get("tool")
        tool = self.tools.get(tool_name) if isinstance(tool_name, str) else None
        if tool is None:
            return self._reject(
                peer, req_id, P.E_UNKNOWN_TOOL, f"no tool {P.short_repr(tool_name)} here; tools: {sorted(self.tools)}"
            )
        timeout_s = msg.get("timeout_s")
        if not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool) or math.isnan(timeout_s):
            return self._reject(peer, req_id, P.E_MALFORMED, "call needs a numeric 'timeout_s' (seconds left)")
        if timeout_s <= 0:
            return self._reject(peer, req_id, P.E_DEADLINE, f"deadline already passed ({timeout_s:.3f} s left)")
        args = msg.get("args")
        problem = P.validate_args(args, tool.spec.parameters)
        if problem:
            return self._reject(peer, req_id, P.E_INVALID_ARGS, problem)
        if self._draining:
            return self._reject(peer, req_id, P.E_SHUTTING_DOWN, "server is stopping; not executed")
        queue = self._outbound.get(peer)
        if queue is not None and queue.stalled:
            return self._reject(
                peer, req_id, P.E_OVERLOADED,
                "your earlier replies are not being read (this server's queue to you is full); not executed",
            )
        if self._num_in_flight >= self.config.max_in_flight:
            return self._reject(
                peer, req_id, P.E_OVERLOADED,
                f"{self._num_in_flight} calls in flight (max_in_flight); not executed, retry later or elsewhere",
            )
        self._num_in_flight += 1
        return tool.spec.name, Job(peer, req_id, args, now, now + float(timeout_s))

    def _reject(self, peer: bytes, req_id: int | None, err_type: str, message: str) -> None:
        self.stats.num_errors[err_type] += 1
        self._send_later(peer, P.error_reply(req_id, err_type, message))
        return None

    # --- replies ---------------------------------------------------------------------------------

    def _finish(self, done: list[tuple[Job, Outcome]]) -> None:
        now = time.monotonic()
        for job, outcome in done:
            latency_s = now - job.received_s
            if outcome.ok:
                self.stats.num_calls_ok += 1
                payload = P.reply(job.req_id, outcome.content, latency_s)
            else:
                assert outcome.error is not None
                self.stats.num_errors[outcome.error.type] += 1
                payload = P.error_reply(job.req_id, outcome.error.type, outcome.error.message, latency_s)
            if len(payload) > self.config.max_reply_frame_bytes:
                self.stats.num_errors[P.E_REPLY_TOO_LARGE] += 1
                message = (f"the result is {len(payload)} bytes packed; this server sends at most "
                           f"{self.config.max_reply_frame_bytes} (max_reply_frame_bytes)")
                payload = P.error_reply(job.req_id, P.E_REPLY_TOO_LARGE, message, latency_s)
            self._hold(job.peer, payload, counted=True)

    def _send_later(self, peer: bytes, payload: bytes) -> None:
        self._hold(peer, payload, counted=False)

    def _hold(self, peer: bytes, payload: bytes, counted: bool) -> None:
        queue = self._outbound.get(peer)
        if queue is None:
            queue = self._outbound[peer] = _PeerQueue()
        queue.replies.append((payload, counted))
        queue.num_bytes += len(payload)
        if queue.stalled and queue.num_bytes > self.config.max_held_reply_bytes:
            self.stats.num_replies_dropped_stalled += len(queue.replies)
            log.warning("peer %s reads no replies: %d replies (%d bytes) held for it dropped (%d so far)",
                        peer.hex()[:32], len(queue.replies), queue.num_bytes, self.stats.num_replies_dropped_stalled)
            self._release(queue.replies)
            del self._outbound[peer]

    def _release(self, items: list[tuple[bytes, bool]]) -> None:
        self._num_in_flight -= sum(counted for _, counted in items)

    def _flush(self, sock: zmq.Socket) -> None:
        for peer in list(self._outbound):
            queue = self._outbound[peer]
            while queue.replies:
                frame, num_items = self._next_frame(queue.replies)
                try:
                    sock.send_multipart([peer, frame], zmq.NOBLOCK)
                except zmq.Again:
                    queue.stalled = True  # its ZeroMQ queue is full: keep the rest, serve the others
                    break
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EHOSTUNREACH:
                        raise
                    self.stats.num_replies_unroutable += len(queue.replies)
                    log.info("%d replies to a disconnected peer dropped (%d so far)", len(queue.replies),
                             self.stats.num_replies_unroutable)
                    num_items = len(queue.replies)
                sent = queue.replies[:num_items]
                del queue.replies[:num_items]
                queue.num_bytes -= sum(len(payload) for payload, _ in sent)
                queue.stalled = False
                self._release(sent)
            if not queue.replies:
                del self._outbound[peer]

    def _next_frame(self, replies: list[tuple[bytes, bool]]) -> tuple[bytes, int]:
        """The longest prefix of `replies` that fits one frame (at least one reply), packed."""
        if len(replies) == 1:
            return replies[0][0], 1
        budget = self.config.max_reply_frame_bytes - 5  # the array header
        num_items = 0
        for payload, _ in replies:
            if num_items and len(payload) > budget:
                break
            budget -= len(payload)
            num_items += 1
        if num_items == 1:
            return replies[0][0], 1
        return P.pack_array([payload for payload, _ in replies[:num_items]]), num_items


def _request_id(msg: Any) -> int | None:
    """The request's id if it is a map with an integer id (booleans are not ids), else None."""
    if isinstance(msg, dict):
        req_id = msg.get("id")
        if isinstance(req_id, int) and not isinstance(req_id, bool):
            return req_id
    return None


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        stream=sys.stderr, level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
