"""Orchestrator -> learner streaming of trajectory groups, acknowledged; learner -> orchestrator versions.

Sockets (loopback by default):
    orchestrator GroupSender (DEALER, connects) ──groups──> learner GroupReceiver (ROUTER, binds)
                             <──────── acks ──────────
    orchestrator VersionSubscriber (SUB, connects) <── {"version", "served_version"} ── learner VersionPublisher (PUB, binds)

Security: the tool services' rule (agentrl/common/curve.py). On loopback or ipc:// keys are
optional (plain text without them); off loopback the learner must hold CurveZMQ keys
(`LearnerConfig` refuses the endpoint otherwise). With keys, the binding sockets take
`curve=ServerKeys` (the learner's secret certificate and the directory of authorized client
certificates; a ZAP authenticator thread per socket checks every handshake) and the connecting
ones `curve=ClientKeys` (the learner's public key, the actor's own key pair). A connection whose
handshake the learner refuses (an unknown client key, keys on one side only) carries nothing, and
libzmq ends it for good (no reconnect after a refused handshake), so the learner never sees a frame
of it. The connecting side logs the refusal and counts it in `num_handshakes_refused`; its owner
decides what to do (the actor exits: a refused key is a configuration error, and a sender or
subscriber left without a connection would wait forever). A handshake cut off midway (a learner
restart, or a server key that is not the learner's) is counted in `num_handshakes_failed`, and
ZeroMQ reconnects as usual. Keys on one side only usually end as a refusal, but when the learner
drops the connection before this side has read its greeting, libzmq reports it as a failure
(timing decides), and the reconnects fail until the keys are mended.

Messages. Group: [b"group", *trajectory.encode_group(group)] (msgpack header + raw numpy frames).
Ack: [b"ack", group_id utf-8]. Nack: [b"nack", group_id utf-8 (empty when the message named no
readable id), reason utf-8 (at most 1 KiB)]. Version: one msgpack frame {"version": int,
"served_version": int}.

Delivery invariant: every group handed to `GroupSender.send` reaches the learner's ledger at least
once, and the learner counts it once:
- the sender keeps each group until its ack arrives (`num_unacked`);
- after the DEALER reconnects (learner restarted, connection dropped: a socket-monitor
  CONNECTED event after the first) every unacked group is resent, since ZeroMQ drops what was queued
  in the dead connection; as a last resort, a group unacked for `resend_after_s` is resent too;
- the learner acks a group only once it is in its ledger, and acks duplicates (same group_id)
  again so the sender stops resending, while skipping them. Resends are therefore harmless.

Poison: a group the receiver refuses (`trajectory.decode_group`: wrong types, NaN rewards, token ids
past the vocabulary, ...) is never acked and never reaches the ledger; it is nacked with the
reason. The sender logs the nack, counts it (`num_rejected`, reasons in `rejected`) and forgets the
group: it is dropped, not retried, since resending the same bytes can only be refused again (and an
unanswered group would be resent forever, holding one of the `max_unacked` slots each time). The
sender also drops, the same way, a group it cannot send: a non-str group id, an array that does not
fit the wire's int32, or a frame over `max_frame_bytes` (the receiver's MAXMSGSIZE: ZeroMQ would
cut the connection on it, and the reconnect would resend it into the same cut forever).

Sizes: the learner's sockets (the ones that bind) set ZeroMQ's MAXMSGSIZE, a per-frame bound, so a
larger inbound frame is never buffered: ZeroMQ drops that peer's connection instead, and the peer
reconnects. The receiver's bound is its `max_frame_bytes` (the learner's `max_group_frame_bytes`);
the version publisher reads only subscriptions (`CONTROL_MAX_FRAME_BYTES`). The connecting sockets
(sender, subscriber) set none: libzmq ends a connecting session for good on that protocol error (no
reconnect; seen with a SUB), so a bound there would turn one oversized answer from the learner into
a sender or subscriber cut off for the rest of the run. A nack to a sender that does not read is
dropped, not waited for.

Backpressure: `send` blocks while `max_unacked` groups await an ack, so a learner that falls
behind stops the orchestrator (which then stops starting episodes) instead of growing memory.
Memory on the sender is bounded by max_unacked groups.

Version updates: the publisher re-sends the latest pair every `republish_interval_s`, so a
subscriber that (re)connects late learns the current versions within that interval (PUB/SUB drops
messages sent before a subscriber joins).

Shutdown: `close(timeout_s)` cancels the background tasks this object owns and closes its sockets
with linger 0; it does not wait for acks (unacked groups are reported by `num_unacked`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from agentrl.common.curve import ClientKeys, ServerKeys, curve_client, curve_server, stop_authenticator
from agentrl.common.trajectory import GroupRejected, TrajectoryGroup, decode_group, encode_group

log = logging.getLogger(__name__)

GROUP, ACK, NACK = b"group", b"ack", b"nack"

DEFAULT_MAX_GROUP_FRAME_BYTES = 64 << 20
"""Largest frame of a group message (the header or one array) either end accepts by default.
The largest legitimate frame is a long trajectory's token_ids: 4 bytes a token, so a 128k-token
context is 512 KiB and 64 MiB holds 16M tokens; a header is about 100 bytes per turn (a 64-sample
group of 200 turns: ~1.3 MiB)."""
CONTROL_MAX_FRAME_BYTES = 64 << 10
"""MAXMSGSIZE of the version publisher, which reads only subscriptions (a few bytes each)."""
MAX_REASON_BYTES = 1024
HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
"""Monitor events of a failed security handshake on a connecting socket. AUTH (ZAP refused the
client key) and PROTOCOL (the two sides' mechanisms differ: keys on one side only) end the
connection for good; NO_DETAIL (the connection dropped mid-handshake: a learner restart, or a
server key that is not the learner's, so it cannot decrypt) is followed by ZeroMQ's usual reconnect."""


def _note_handshake(owner: GroupSender | VersionSubscriber, event: dict) -> None:
    """Count and log a failed handshake of `owner`'s socket (module docstring: Security)."""
    who, curve = type(owner).__name__, owner.curve
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        owner.num_handshakes_failed += 1
        # Once for a learner that restarted mid-handshake; on every reconnect (each ~130 ms) for a
        # wrong server key: log the first and every 100th.
        if owner.num_handshakes_failed % 100 == 1:
            log.warning("%s: a handshake with the learner at %s failed (%d so far; ZeroMQ reconnects)%s", who,
                        owner.endpoint, owner.num_handshakes_failed,
                        ": if it repeats, is curve_server_key the learner's public key?" if curve is not None
                        else ": if it repeats, does the learner expect CurveZMQ keys? this side has none")
        return
    owner.num_handshakes_refused += 1
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        why = "refused this client's CurveZMQ key: is its public key in the learner's curve_authorized_clients_dir?"
    else:
        why = (f"uses another security mechanism: this side {'has' if curve is not None else 'has no'} CurveZMQ keys "
               "and the learner's socket does not; give both sides keys, or neither")
    log.error("%s: the learner at %s %s (ZeroMQ does not retry a refused handshake)", who, owner.endpoint, why)


class _Owned:
    """Owns a zmq context and background tasks; `_stop` cancels them within a bound."""

    def __init__(self) -> None:
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task] = []
        self._auth: ThreadAuthenticator | None = None
        """The ZAP authenticator of a CURVE server socket (its thread uses `_ctx`: stopped first)."""

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._report)
        self._tasks.append(task)

    @staticmethod
    def _report(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("transport task %s died: %r", task.get_name(), task.exception())

    async def _stop(self, timeout_s: float, bound: zmq.asyncio.Socket | None = None) -> None:
        """`bound`: a CURVE server socket, closed before its authenticator stops (a handshake that
        met the socket without its ZAP handler would be let in unchecked: libzmq's default)."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s)
        self._tasks.clear()
        if bound is not None:
            bound.close(linger=0)
        stop_authenticator(self._auth)
        self._auth = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None


class GroupSender(_Owned):
    def __init__(self, endpoint: str, *, max_unacked: int = 32, resend_after_s: float = 60.0,
                 max_frame_bytes: int = DEFAULT_MAX_GROUP_FRAME_BYTES, max_reasons_kept: int = 1000,
                 curve: ClientKeys | None = None):
        super().__init__()
        if max_unacked < 1:
            raise ValueError("GroupSender.max_unacked must be >= 1")
        self.endpoint = endpoint
        self.max_unacked = max_unacked
        self.resend_after_s = resend_after_s
        """A group unacked this long is resent (the learner dedups), seconds."""
        self.max_frame_bytes = max_frame_bytes
        """Largest frame sent, in bytes: the receiver's MAXMSGSIZE (a larger group is dropped here)."""
        self.max_reasons_kept = max_reasons_kept
        """How many of the latest rejections `rejected` keeps (all are counted)."""
        self.curve = curve
        """CurveZMQ keys for a receiver that requires them (agentrl/common/curve.py); None: plain text."""
        self._unacked: OrderedDict[str, tuple[list[bytes], float]] = OrderedDict()
        self._space = asyncio.Condition()
        self._sock: zmq.asyncio.Socket | None = None
        self._resend_on_connect = False
        """Set by `move`: the groups sent towards the old endpoint are resent at the first connect."""
        self.num_sent = 0
        self.num_resent = 0
        self.num_acked = 0
        self.num_rejected = 0
        """Groups dropped: nacked by the receiver, or refused here before sending."""
        self.num_unmatched_nacks = 0
        """Nacks for no group awaiting an answer (a resent copy nacked twice, or a foreign message)."""
        self.num_handshakes_refused = 0
        """Handshakes the receiver refused (module docstring: Security); nothing goes through after one."""
        self.num_handshakes_failed = 0
        """Handshakes cut off midway (module docstring: Security); ZeroMQ reconnects after them."""
        self.rejected: OrderedDict[str, str] = OrderedDict()
        """group id -> why it was dropped, for the latest `max_reasons_kept` rejections."""

    @property
    def num_unacked(self) -> int:
        return len(self._unacked)

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        if self.curve is not None:
            curve_client(self._sock, self.curve)
        monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_EVENTS)
        self._sock.connect(self.endpoint)
        self._spawn(self._read_acks(), "group-sender-acks")
        self._spawn(self._watch_reconnects(monitor), "group-sender-monitor")
        self._spawn(self._resend_stale(), "group-sender-resend")

    async def close(self, timeout_s: float = 5.0) -> None:
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
        await self._stop(timeout_s)
        self._sock = None

    def move(self, endpoint: str) -> None:
        """The receiver answers at `endpoint` now (a learner started again on another node): connect
        there instead; every unacked group is resent once connected (the receiver dedups)."""
        if self._sock is None:
            raise RuntimeError("GroupSender.move before start()")
        with contextlib.suppress(zmq.ZMQError):  # not connected there any more: nothing to undo
            self._sock.disconnect(self.endpoint)
        log.warning("GroupSender: the receiver at %s answers at %s now", self.endpoint, endpoint)
        self.endpoint = endpoint
        self._resend_on_connect = True
        self._sock.connect(endpoint)

    async def send(self, group: TrajectoryGroup) -> None:
        """Send `group` (blocks while `max_unacked` groups wait). A group that cannot go on the wire
        is dropped, logged and counted like a nacked one, rather than raised into the producer."""
        if self._sock is None:
            raise RuntimeError("GroupSender.send before start()")
        frames = self._frames(group)
        if frames is None:
            return
        async with self._space:
            await self._space.wait_for(lambda: len(self._unacked) < self.max_unacked)
            self._unacked[group.group_id] = (frames, time.monotonic())
        await self._sock.send_multipart(frames, copy=False)
        self.num_sent += 1

    def _frames(self, group: TrajectoryGroup) -> list[bytes] | None:
        if not isinstance(group.group_id, str) or not group.group_id:
            self._reject(repr(group.group_id), f"refused before sending: group_id {group.group_id!r} is not a non-empty str")
            return None
        try:
            frames = [GROUP, *encode_group(group)]
        except ValueError as err:
            self._reject(group.group_id, f"refused before sending: {err}")
            return None
        largest = max(len(f) for f in frames)
        if largest > self.max_frame_bytes:
            self._reject(group.group_id, f"refused before sending: a {largest}-byte frame is over the receiver's "
                                         f"max_frame_bytes={self.max_frame_bytes}")
            return None
        return frames

    def _reject(self, group_id: str, reason: str) -> None:
        self.num_rejected += 1
        self.rejected[group_id] = reason
        while len(self.rejected) > self.max_reasons_kept:
            self.rejected.popitem(last=False)
        log.error("GroupSender: group %s dropped: %s", group_id, reason)

    async def wait_all_acked(self, timeout_s: float) -> bool:
        """True once nothing is unacked; False if `timeout_s` passed first."""
        async with self._space:
            try:
                await asyncio.wait_for(self._space.wait_for(lambda: not self._unacked), timeout_s)
            except TimeoutError:
                return False
        return True

    async def _read_acks(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            is_ack, is_nack = len(frames) == 2 and frames[0] == ACK, len(frames) == 3 and frames[0] == NACK
            if not (is_ack or is_nack):
                log.error("GroupSender: ignoring a message that is neither an ack nor a nack (%d frames)", len(frames))
                continue
            group_id = frames[1].decode(errors="replace")
            async with self._space:
                answered = self._unacked.pop(group_id, None) is not None
                if answered:
                    self._space.notify_all()
            if is_ack:
                self.num_acked += answered
            elif answered:
                self._reject(group_id, f"nacked by the receiver: {frames[2].decode(errors='replace')}")
            else:
                self.num_unmatched_nacks += 1
                log.warning("GroupSender: nack for no group awaiting an answer (%r): %s", group_id,
                            frames[2].decode(errors="replace"))

    async def _resend_all(self, reason: str) -> None:
        pending = list(self._unacked.items())
        if pending:
            log.info("GroupSender: resending %d unacked groups (%s)", len(pending), reason)
        for group_id, (frames, _) in pending:
            if group_id in self._unacked:
                self._unacked[group_id] = (frames, time.monotonic())
                await self._sock.send_multipart(frames, copy=False)
                self.num_resent += 1

    async def _watch_reconnects(self, monitor: zmq.asyncio.Socket) -> None:
        num_connects = 0
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_CONNECTED:
                    num_connects += 1
                    if num_connects > 1 or self._resend_on_connect:
                        self._resend_on_connect = False
                        await self._resend_all("reconnected")
                elif event["event"] & HANDSHAKE_EVENTS:
                    _note_handshake(self, event)
        finally:
            monitor.close(linger=0)

    async def _resend_stale(self) -> None:
        while True:
            await asyncio.sleep(min(self.resend_after_s / 4, 5.0))
            now = time.monotonic()
            if any(now - sent_at > self.resend_after_s for _, sent_at in self._unacked.values()):
                await self._resend_all(f"unacked for more than {self.resend_after_s} s")


@dataclass
class ReceivedGroup:
    group: TrajectoryGroup
    sender: bytes
    """ZeroMQ routing id of the sending orchestrator (where the ack goes)."""


RejectHook = Callable[[list[bytes], str, "str | None", bytes], None]
"""(raw frames after the routing id, reason, group id if readable, sender's routing id) -> None."""


class GroupReceiver(_Owned):
    def __init__(self, endpoint: str, *, max_queued_messages: int = 64,
                 max_frame_bytes: int = DEFAULT_MAX_GROUP_FRAME_BYTES, vocab_size: int | None = None,
                 on_reject: RejectHook | None = None, curve: ServerKeys | None = None):
        super().__init__()
        self.endpoint = endpoint
        self.max_queued_messages = max_queued_messages
        """ROUTER receive high-water mark, in messages; beyond it the senders' DEALERs block."""
        self.max_frame_bytes = max_frame_bytes
        """ZeroMQ MAXMSGSIZE, bytes: a peer sending a larger frame is disconnected before it is buffered."""
        self.vocab_size = vocab_size
        """Token ids must lie in [0, vocab_size) (None: not checked)."""
        self.on_reject = on_reject
        """Called with every refused message before it is nacked (the learner keeps them in rejected/)."""
        self.curve = curve
        """CurveZMQ keys: senders must hold an authorized client key (agentrl/common/curve.py); None: plain text."""
        self._sock: zmq.asyncio.Socket | None = None
        self.num_malformed = 0
        """Messages refused (nacked): not a group, or a group that fails `decode_group`'s checks."""
        self.num_unroutable_acks = 0
        self.num_dropped_nacks = 0
        """Nacks not delivered: the sender was gone or did not read its answers."""

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an ack to a vanished sender raises instead of vanishing
        self._sock.setsockopt(zmq.RCVHWM, self.max_queued_messages)
        self._sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        if self.curve is not None:
            self._auth = curve_server(self._ctx, self._sock, self.curve)
        self._sock.bind(self.endpoint)

    async def close(self, timeout_s: float = 5.0) -> None:
        await self._stop(timeout_s, bound=self._sock)
        self._sock = None

    async def recv(self) -> ReceivedGroup:
        """The next group that passes `decode_group`'s checks. Any other message is refused: logged,
        counted in `num_malformed`, handed to `on_reject`, and nacked with the reason (never acked,
        so it reaches no ledger); the learner keeps running."""
        if self._sock is None:
            raise RuntimeError("GroupReceiver.recv before start()")
        while True:
            frames = await self._sock.recv_multipart(copy=True)
            sender, kind, payload = frames[0], frames[1] if len(frames) > 1 else b"", frames[2:]
            if kind != GROUP:
                await self._refuse(sender, frames[1:], f"message of unknown kind {kind[:16]!r}", None)
                continue
            try:
                return ReceivedGroup(decode_group(payload, vocab_size=self.vocab_size), sender)
            except GroupRejected as err:
                await self._refuse(sender, frames[1:], err.reason, err.group_id)

    async def _refuse(self, sender: bytes, frames: list[bytes], reason: str, group_id: str | None) -> None:
        self.num_malformed += 1
        log.error("GroupReceiver: refused group %r from %r: %s", group_id, sender, reason)
        if self.on_reject is not None:
            self.on_reject(frames, reason, group_id, sender)
        nack = [sender, NACK, (group_id or "").encode(), reason.encode()[:MAX_REASON_BYTES]]
        try:
            # Not waited for: a peer that sends junk and never reads must not stall the receiver.
            await self._sock.send_multipart(nack, flags=zmq.NOBLOCK)
        except zmq.error.ZMQError as err:
            if err.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            self.num_dropped_nacks += 1
            log.warning("GroupReceiver: nack for group %r not delivered (%s)", group_id, err.strerror)

    async def ack(self, received: ReceivedGroup) -> None:
        try:
            await self._sock.send_multipart([received.sender, ACK, received.group.group_id.encode()])
        except zmq.error.ZMQError as err:
            if err.errno != zmq.EHOSTUNREACH:
                raise
            # The sender disconnected; it resends its unacked groups when it reconnects, and they are acked then.
            self.num_unroutable_acks += 1
            log.warning("GroupReceiver: sender of group %s is gone; its resend will be acked", received.group.group_id)


class VersionPublisher(_Owned):
    def __init__(self, endpoint: str, *, republish_interval_s: float = 1.0, curve: ServerKeys | None = None):
        super().__init__()
        self.endpoint = endpoint
        self.republish_interval_s = republish_interval_s
        self.curve = curve
        """CurveZMQ keys: subscribers must hold an authorized client key; None: plain text."""
        self._sock: zmq.asyncio.Socket | None = None
        self._latest: tuple[int, int] | None = None
        """(version, served version) as last announced; sent again every `republish_interval_s`."""

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_FRAME_BYTES)  # inbound: subscriptions only
        if self.curve is not None:
            self._auth = curve_server(self._ctx, self._sock, self.curve)
        self._sock.bind(self.endpoint)
        self._spawn(self._republish(), "version-republish")

    async def publish(self, version: int, served_version: int) -> None:
        self._latest = (int(version), int(served_version))
        await self._send()

    def set_served(self, served_version: int) -> None:
        """The servers caught up between two versions (a push finished, a restarted server took the
        latest weights): the next republish, within `republish_interval_s`, says so. Before the first
        `publish` there is nothing to amend."""
        if self._latest is not None:
            self._latest = (self._latest[0], int(served_version))

    async def close(self, timeout_s: float = 5.0) -> None:
        await self._stop(timeout_s, bound=self._sock)
        self._sock = None

    async def _republish(self) -> None:
        while True:
            await asyncio.sleep(self.republish_interval_s)
            if self._latest is not None:
                await self._send()

    async def _send(self) -> None:
        version, served_version = self._latest
        await self._sock.send(msgpack.packb({"version": version, "served_version": served_version}))


class VersionSubscriber(_Owned):
    def __init__(self, endpoint: str, *, curve: ClientKeys | None = None):
        super().__init__()
        self.endpoint = endpoint
        self.curve = curve
        """CurveZMQ keys for a publisher that requires them; None: plain text."""
        self.latest: tuple[int, int] | None = None
        """(learner version, served version) last heard; None until the first message."""
        self._changed = asyncio.Condition()
        self.num_malformed = 0
        """Version messages that did not decode (logged and skipped)."""
        self.num_handshakes_refused = 0
        """Handshakes the publisher refused (module docstring: Security); nothing arrives after one."""
        self.num_handshakes_failed = 0
        """Handshakes cut off midway (module docstring: Security); ZeroMQ reconnects after them."""
        self._sock: zmq.asyncio.Socket | None = None

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        if self.curve is not None:
            curve_client(sock, self.curve)
        monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS)
        sock.connect(self.endpoint)
        self._spawn(self._listen(sock), "version-subscriber")
        self._spawn(self._watch_handshakes(monitor), "version-subscriber-monitor")

    async def close(self, timeout_s: float = 5.0) -> None:
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
        await self._stop(timeout_s)
        self._sock = None

    def move(self, endpoint: str) -> None:
        """The publisher answers at `endpoint` now: subscribe there instead (`latest` is kept until
        it speaks)."""
        if self._sock is None:
            raise RuntimeError("VersionSubscriber.move before start()")
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disconnect(self.endpoint)
        log.warning("VersionSubscriber: the publisher at %s answers at %s now", self.endpoint, endpoint)
        self.endpoint = endpoint
        self._sock.connect(endpoint)

    async def _watch_handshakes(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                _note_handshake(self, parse_monitor_message(await monitor.recv_multipart()))
        finally:
            monitor.close(linger=0)

    async def wait_until(self, pred: Callable[[tuple[int, int]], bool], timeout_s: float | None = None) -> tuple[int, int]:
        """Wait until `pred(latest)` holds (latest not None); raises TimeoutError after `timeout_s`."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: self.latest is not None and pred(self.latest)), timeout_s)
            return self.latest

    async def _listen(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            raw = await sock.recv()
            try:
                msg = msgpack.unpackb(raw)
                latest = (msg["version"], msg["served_version"])
                if not all(type(v) is int for v in latest):
                    raise TypeError(f"versions {latest!r} are not ints")
            except (ValueError, KeyError, TypeError, msgpack.UnpackException) as err:
                self.num_malformed += 1
                log.error("VersionSubscriber: skipping a malformed version message (%d bytes): %s", len(raw), err)
                continue
            if latest != self.latest:
                async with self._changed:
                    self.latest = latest
                    self._changed.notify_all()
