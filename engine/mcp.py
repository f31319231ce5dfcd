"""MCP servers as tools: any Model Context Protocol server (stdio or streamable HTTP) becomes `Tool`s.

    server = McpServer(McpServerConfig(command="mcp-server-time", args=("--local-timezone", "UTC")))
    await server.start()                  # child process + one MCP session; lists the tools
    for tool in server.tools:             # McpTool: the server's own names, descriptions, input schemas
        env.register_tool(tool)           # the ToolEnv validates arguments against those schemas
    ...
    await server.close()                  # bounded: stdin closed, SIGTERM, then SIGKILL of the group

The `ToolEnv` cannot tell an `McpTool` from a local or a ZeroMQ tool: it has the same attributes and
`execute(arguments, timeout_s) -> ToolResult`.

Lifecycle. `McpServer` owns one connection (one MCP session) at a time, shared by all its tools.
A supervisor task opens it, waits until it is lost or `close` is asked, tears it down, and opens
the next one. The SDK's task groups are entered and left in that one task (anyio requires it);
calls from any task only send requests on the session. For stdio the connection is a child
process this module starts (its own session and process group, stderr appended to a log file)
and stops by its PID: stdin closed (the MCP shutdown sequence), `stop_grace_s`, SIGTERM to the
group, `sigterm_grace_s`, SIGKILL to the group. For HTTP it is a session to the URL (the server's
process is someone else's).

Failure contract (a deliberate choice; see `McpServer.call`):
- The tool ran and failed (`isError` result), the server rejected the call (a JSON-RPC error),
  its answer did not conform, or the call passed its deadline: a failed `ToolResult` whose
  `error` the model reads. A timed-out request is cancelled on the server; the session stays up.
- The server died (or the HTTP session broke): the calls in flight and the calls until it is back
  also fail as tool errors ("server_unavailable"), not `ToolUnavailable`. An MCP server is
  third-party code that runs what the model sends; a crash is most often the call's own doing, and
  it is one process, restarted after 0.5 s (answering again 1.5 to 2 s after a crash here), so
  marking every episode that met the outage as failed would drop the episodes where the policy
  broke the tool. The outage stays visible: restarts are counted (`num_restarts`) and logged with
  the exit status.
- `ToolUnavailable` is raised only when the server cannot be reached at all by this object: it was
  never started, it is closed, or its supervisor task failed.

Restarts: after a loss the supervisor waits `restart_initial_delay_s` (0.5 s), doubling after each
restart up to `restart_max_delay_s` (30 s); a connection that stayed up `healthy_reset_s` (60 s)
resets the delay. The first connection is not retried: a server that cannot start at all is a
configuration error, and `start` raises `McpStartError` with the tail of its stderr.

Results: `structuredContent` when the server sent it, kept as JSON (the typed result; the text block
beside it is by the spec its serialization, here pretty-printed: 144 tokens against the 126 of the
env's compact rendering for a `convert_time` result, SmolLM2 tokenizer), else the text of the
content blocks joined with newlines (non-text blocks as a placeholder naming their type and size).

Imports only the standard library, the `mcp` SDK (and anyio, the SDK's own stream layer: its memory
streams are what `mcp.Client` reads a transport through) and `agentrl.engine.tools`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import signal
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import mcp.types as mcp_types
from mcp import Client
from mcp.client.stdio import get_default_environment
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage

from agentrl.common.config import config_dataclass
from agentrl.common.proctable import live_group_members, signal_group
from agentrl.engine.tools import Tool, ToolResult, ToolUnavailable

log = logging.getLogger(__name__)

# Error types of a failed McpToolResult (the first two as the ZeroMQ tool protocol names them).
E_TOOL = "tool_error"  # the server ran the tool and returned isError
E_DEADLINE = "deadline_exceeded"  # no answer within the call's deadline
E_PROTOCOL = "protocol_error"  # the server rejected the request, or its answer did not conform
E_UNAVAILABLE = "server_unavailable"  # the server died or is being restarted

_EXIT_POLL_S = 0.02  # while stopping a child
_EXIT_WATCH_S = 0.1  # while it runs: a death is seen at most this late (its stdout's EOF usually comes first)
_KILL_REAP_S = 2.0  # after SIGKILL only an unkillable (D-state) process takes longer
_WRITE_MARGIN_S = 0.5  # the outer deadline also covers a write stuck on a full pipe; under the env's 1 s
_MAX_LIST_PAGES = 100
_STDERR_TAIL_BYTES = 2000


class McpStartError(RuntimeError):
    """The MCP server could not be started or connected to (the first connection failed)."""


@config_dataclass
class McpServerConfig:
    """One MCP server: a command (stdio) or a URL (streamable HTTP), exactly one of them."""

    command: str | None = None
    """Executable that speaks MCP over stdio (looked up on PATH)."""
    args: tuple[str, ...] = ()
    """Its arguments."""
    url: str | None = None
    """Streamable-HTTP endpoint, e.g. http://127.0.0.1:8000/mcp."""
    name: str | None = None
    """Label in logs and errors; default: the command's file name, or the URL."""
    env: dict[str, str] | None = None
    """Extra environment for the child. It otherwise gets only the SDK's safe set (HOME, LOGNAME,
    PATH, SHELL, TERM, USER), so the trainer's secrets do not reach a third-party server."""
    cwd: str | None = None
    """Working directory of the child (default: this process's)."""
    stderr_log_path: str | None = None
    """The child's stderr is appended here; default: <tmp>/agentrl-mcp/<name>.<our pid>.log."""
    start_timeout_s: float = 30.0
    """Spawn + handshake + tool listing, per connection. mcp-server-time takes ~0.7 s."""
    call_timeout_s: float = 30.0
    """Deadline of a call that names none (the env always names one: EnvConfig.tool_timeout_s)."""
    stop_grace_s: float = 2.0
    """After closing the child's stdin, how long it may take to exit by itself."""
    sigterm_grace_s: float = 2.0
    """After SIGTERM to the child's process group, how long before SIGKILL."""
    close_timeout_s: float = 15.0
    """Bound on `close` (the stop sequence takes at most ~6 s); past it the group is SIGKILLed."""
    restart_initial_delay_s: float = 0.5
    """Wait before the first restart after a loss; doubles per restart."""
    restart_max_delay_s: float = 30.0
    """Cap of the doubling wait."""
    healthy_reset_s: float = 60.0
    """A connection that stayed up this long resets the wait to restart_initial_delay_s."""
    max_message_bytes: int = 16 << 20
    """Largest JSON-RPC line read from a stdio server; a longer one ends the connection."""

    def __post_init__(self) -> None:
        if (self.command is None) == (self.url is None):
            raise ValueError("command: an MCP server needs exactly one of `command` (stdio) and `url` (streamable HTTP)")
        if self.command is not None and not self.command.strip():
            raise ValueError("command: is empty")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: must be an http(s) URL, got {self.url!r}")
        for key in ("start_timeout_s", "call_timeout_s", "close_timeout_s", "restart_initial_delay_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key}: must be > 0, got {getattr(self, key)}")
        if self.restart_max_delay_s < self.restart_initial_delay_s:
            raise ValueError("restart_max_delay_s: must be >= restart_initial_delay_s")
        if self.name is None:
            self.name = Path(self.command).name if self.command is not None else self.url

    @classmethod
    def from_command_line(cls, command_line: str, **fields: Any) -> McpServerConfig:
        """`"mcp-server-time --local-timezone UTC"` split as a POSIX shell would (no shell runs)."""
        words = shlex.split(command_line)
        if not words:
            raise ValueError("the MCP server command line is empty")
        return cls(command=words[0], args=tuple(words[1:]), **fields)


@dataclass
class McpToolResult(ToolResult):
    error_type: str | None = None
    """On failure, one of E_TOOL, E_DEADLINE, E_PROTOCOL, E_UNAVAILABLE."""


class McpTool(Tool):
    """One tool of an `McpServer`, as the server lists it."""

    def __init__(self, server: McpServer, spec: mcp_types.Tool):
        self.name = spec.name
        self.description = spec.description or spec.title or ""
        self.parameters = dict(spec.input_schema)
        self.idempotent = bool(spec.annotations and spec.annotations.idempotent_hint)
        self._server = server

    async def execute(self, arguments: dict, timeout_s: float | None = None) -> McpToolResult:
        return await self._server.call(self.name, arguments, timeout_s)

    def describe(self) -> dict:
        """The entry `agentrl tool describe` prints (the ZeroMQ services' describe shape)."""
        return {**self.schema(), "idempotent": self.idempotent}


class _Connection:
    """One live MCP session (and, for stdio, the child process behind it)."""

    def __init__(self) -> None:
        self.client: Client | None = None
        self.process: asyncio.subprocess.Process | None = None
        self.tools: list[mcp_types.Tool] = []
        self.lost = asyncio.Event()
        self.reason: str | None = None
        """Why it was lost (first cause wins)."""

    def lose(self, reason: str) -> None:
        if not self.lost.is_set():
            self.reason = reason
            self.lost.set()

    def describe_loss(self) -> str:
        reason = self.reason or "lost"
        if self.process is not None and self.process.returncode is not None:
            reason += f"; pid {self.process.pid} exit status {self.process.returncode}"
        return reason


class McpServer:
    """Owner of one MCP server's connection; see the module docstring for the lifecycle.

    Bound to the event loop `start` ran on. Also an async context manager (start / close)."""

    def __init__(self, config: McpServerConfig):
        self.config = config
        self.name: str = config.name or ""
        self.tools: list[McpTool] = []
        """The server's tools, from the first connection's listing."""
        self.num_restarts = 0
        """Connections opened after a loss (successful or not)."""
        self.log_path: str | None = None
        """Where the stdio child's stderr goes."""
        self._conn: _Connection | None = None
        self._supervisor: asyncio.Task | None = None
        self._closing = asyncio.Event()
        self._log_file = None
        self._process: asyncio.subprocess.Process | None = None
        self._log_offset = 0
        """Size of the log when the current child started (a start failure quotes only its lines)."""
        self._last_loss = "not connected yet"
        self._last_exit_status: int | None = None
        self._restart_delay_s = config.restart_initial_delay_s

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the first connection and list the tools. Raises McpStartError if that fails."""
        if self._supervisor is not None:
            raise RuntimeError(f"MCP server {self.name!r} was already started")
        if self.config.command is not None:
            self.log_path = self.config.stderr_log_path or _default_log_path(self.name)
            Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in close()
        first = asyncio.get_running_loop().create_future()
        self._supervisor = asyncio.create_task(self._supervise(first), name=f"mcp-supervisor-{self.name}")
        try:
            await first
        except BaseException:
            await self.close()
            raise
        self.tools = [McpTool(self, spec) for spec in first.result()]
        log.info("MCP server %r: %d tools (%s)%s", self.name, len(self.tools), ", ".join(t.name for t in self.tools),
                 f"; pid {self.pid}, stderr -> {self.log_path}" if self.pid else "")

    async def close(self) -> None:
        """Stop the server (bounded by close_timeout_s). Idempotent."""
        self._closing.set()
        if self._conn is not None:
            self._conn.lose("closing")
        task, cfg = self._supervisor, self.config
        try:
            if task is not None and not task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(task), cfg.close_timeout_s)
                except TimeoutError:
                    log.error("MCP server %r did not stop within %.0f s; cancelling its supervisor", self.name,
                              cfg.close_timeout_s)
                    task.cancel()
                    await asyncio.wait({task}, timeout=_KILL_REAP_S)
        finally:
            if self._process is not None:  # the stop sequence was cut short: no survivors all the same
                signal_group(self._process.pid, signal.SIGKILL)
                self._process = None
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None
                if self.config.stderr_log_path is None and os.path.getsize(self.log_path) == 0:
                    os.unlink(self.log_path)  # a default log with nothing in it is not worth keeping
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            err = task.exception()
            if not isinstance(err, McpStartError):  # start() already raised that one
                raise err

    async def __aenter__(self) -> McpServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    @property
    def pid(self) -> int | None:
        """PID of the current stdio child (None for HTTP, or while it is down)."""
        return self._process.pid if self._process is not None else None

    # -- calls ---------------------------------------------------------------------------------------

    async def call(self, tool: str, arguments: dict, timeout_s: float | None = None) -> McpToolResult:
        """Call one tool; every outcome but "cannot be reached at all" is a result (module docstring)."""
        start = time.perf_counter()
        conn = self._connection()
        if conn is None or conn.lost.is_set():
            reason = conn.describe_loss() if conn is not None else self._last_loss
            return _failed(start, E_UNAVAILABLE, f"the MCP server {self.name!r} is down ({reason}) and is being restarted")
        timeout_s = timeout_s or self.config.call_timeout_s
        try:
            # The SDK's read timeout cancels the request on the server and keeps the session; the
            # outer bound covers the write, which the read timeout does not.
            async with asyncio.timeout(timeout_s + _WRITE_MARGIN_S):
                result = await conn.client.call_tool(tool, arguments, read_timeout_seconds=timeout_s)
        except TimeoutError:
            return _failed(start, E_DEADLINE, f"timed out after {timeout_s} s")
        except MCPError as err:
            if err.code == mcp_types.REQUEST_TIMEOUT:
                return _failed(start, E_DEADLINE, f"timed out after {timeout_s} s")
            if err.code == mcp_types.CONNECTION_CLOSED:
                conn.lose("the connection closed during a call")
                return _failed(start, E_UNAVAILABLE, f"the MCP server {self.name!r} went away during the call; "
                                                     "it is being restarted")
            return _failed(start, E_PROTOCOL, f"MCP error {err.code}: {err.message}")
        except (RuntimeError, ValueError) as err:
            # What the SDK raises about the server's answer itself: structured content that fails the
            # tool's output schema (RuntimeError), a result that fails the protocol's types
            # (pydantic.ValidationError, a ValueError).
            return _failed(start, E_PROTOCOL, f"unusable answer from the MCP server: {err}")
        return _tool_result(result, time.perf_counter() - start)

    def _connection(self) -> _Connection | None:
        if self._supervisor is None:
            raise ToolUnavailable(f"MCP server {self.name!r} was never started")
        if self._closing.is_set():
            raise ToolUnavailable(f"MCP server {self.name!r} is closed")
        if self._supervisor.done():
            raise ToolUnavailable(f"the supervisor of MCP server {self.name!r} failed: {self._supervisor.exception()!r}")
        return self._conn

    # -- supervision ---------------------------------------------------------------------------------

    async def _supervise(self, first: asyncio.Future) -> None:
        """Open, hold and reopen the connection until close; the only task that enters the SDK's contexts."""
        try:
            while not self._closing.is_set():
                opened_at, cause = None, None
                try:
                    async with self._connect() as conn:
                        opened_at = time.monotonic()
                        self._on_connected(conn, first)
                        await conn.lost.wait()
                    reason = self._last_loss = conn.describe_loss()  # after the stop: the exit status is known
                except Exception as err:  # noqa: BLE001 - the server's failure: logged below and retried
                    reason, cause = _describe_error(err), err
                    self._last_loss = reason
                    if not first.done():
                        raise McpStartError(self._start_failure_message(reason)) from err
                finally:
                    self._conn = None
                if self._closing.is_set():
                    return
                await self._wait_before_restart(opened_at, reason, cause)
        except BaseException as err:
            if not first.done():
                first.set_exception(err if isinstance(err, McpStartError) else McpStartError(
                    f"MCP server {self.name!r}: the supervisor ended before the first connection ({err!r})"))
            raise

    async def _wait_before_restart(self, opened_at: float | None, reason: str, cause: BaseException | None) -> None:
        cfg = self.config
        uptime_s = time.monotonic() - opened_at if opened_at is not None else 0.0
        if uptime_s >= cfg.healthy_reset_s:
            self._restart_delay_s = cfg.restart_initial_delay_s
        delay_s = self._restart_delay_s
        self._restart_delay_s = min(2 * delay_s, cfg.restart_max_delay_s)
        self.num_restarts += 1
        log.warning("MCP server %r lost after %.1f s (%s); restart %d in %.1f s", self.name, uptime_s, reason,
                    self.num_restarts, delay_s)
        if cause is not None:  # the traceback too, but not at every attempt of a long outage
            log.debug("MCP server %r: what ended the last attempt", self.name, exc_info=cause)
        try:
            await asyncio.wait_for(self._closing.wait(), delay_s)
        except TimeoutError:
            pass

    def _on_connected(self, conn: _Connection, first: asyncio.Future) -> None:
        self._conn = conn
        if self._closing.is_set():  # close() ran while this connection was opening
            conn.lose("closing")
        if not first.done():
            first.set_result(conn.tools)
            return
        log.info("MCP server %r restarted (restart %d%s)", self.name, self.num_restarts,
                 f", pid {conn.process.pid}" if conn.process else "")
        listed = {t.name: t.input_schema for t in conn.tools}
        known = {t.name: t.parameters for t in self.tools}
        if listed != known:
            log.warning("MCP server %r lists different tools after its restart (%s); the registered tools keep "
                        "the first listing", self.name, sorted(set(listed) ^ set(known)) or "schemas changed")

    @asynccontextmanager
    async def _connect(self) -> AsyncIterator[_Connection]:
        conn = _Connection()
        timeout_s = self.config.start_timeout_s
        async with AsyncExitStack() as stack:
            try:
                async with asyncio.timeout(timeout_s):
                    transport = await self._open_transport(conn, stack)
                    client = Client(transport, mode="auto", cache=None,
                                    client_info=mcp_types.Implementation(name="agentrl", version="0.1.0"))
                    conn.client = await stack.enter_async_context(client)
                    conn.tools = await _list_all_tools(client)
            except TimeoutError as err:
                raise TimeoutError(f"no handshake and tool listing within start_timeout_s={timeout_s}") from err
            yield conn

    async def _open_transport(self, conn: _Connection, stack: AsyncExitStack):
        cfg = self.config
        if cfg.url is not None:
            return cfg.url  # mcp.Client opens its streamable-HTTP transport for a URL
        env = get_default_environment() | (cfg.env or {})
        self._log_offset = self._log_file.tell()
        proc = await asyncio.create_subprocess_exec(
            cfg.command, *cfg.args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=self._log_file, env=env, cwd=cfg.cwd, start_new_session=True, limit=cfg.max_message_bytes)
        conn.process = self._process = proc
        stack.push_async_callback(self._stop_process, proc)  # runs after the session's own exit (LIFO)
        return _stdio_streams(proc, conn, cfg.max_message_bytes)

    async def _stop_process(self, proc: asyncio.subprocess.Process) -> None:
        """MCP shutdown for stdio: close stdin; then SIGTERM, then SIGKILL the process group."""
        cfg = self.config
        if proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()
        # The grace is for the server itself; what it leaves behind in its group gets SIGTERM at once.
        await _wait_exit(proc, cfg.stop_grace_s)
        stopped = not live_group_members(proc.pid)
        for sig, grace_s in ((signal.SIGTERM, cfg.sigterm_grace_s), (signal.SIGKILL, _KILL_REAP_S)):
            if stopped:
                break
            signal_group(proc.pid, sig)
            stopped = await _wait_group_exit(proc, grace_s)
        self._last_exit_status = proc.returncode
        if not stopped:
            log.error("MCP server %r: process group %d still has live members %s after SIGKILL", self.name, proc.pid,
                      live_group_members(proc.pid))
        if self._process is proc:
            self._process = None

    def _start_failure_message(self, reason: str) -> str:
        msg = f"could not start MCP server {self.name!r}: {reason}"
        if self._last_exit_status is not None:
            msg += f" (the server exited with status {self._last_exit_status})"
        if self.log_path is not None:
            tail = _file_tail(self.log_path, self._log_offset)
            msg += f"\n--- its stderr ({self.log_path}) ---\n{tail}" if tail else f" (stderr: {self.log_path}, empty)"
        return msg


# -- stdio transport -----------------------------------------------------------------------------


@asynccontextmanager
async def _stdio_streams(proc: asyncio.subprocess.Process, conn: _Connection, max_message_bytes: int):
    """The child's stdin/stdout as the (read, write) stream pair `mcp.Client` expects: one JSON-RPC
    message per line. A closed stdout, a broken stdin or the child's exit loses the connection."""
    to_session, session_reads = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    session_writes, to_child = anyio.create_memory_object_stream[SessionMessage](0)

    async def child_to_session() -> None:
        async with to_session:
            while True:
                try:
                    line = await proc.stdout.readline()
                except ValueError:  # asyncio's StreamReader: a line longer than its limit
                    conn.lose(f"the server wrote a message over {max_message_bytes} bytes")
                    return
                if not line:
                    conn.lose("the server closed its stdout")
                    return
                if not line.strip():
                    continue
                try:
                    item: SessionMessage | Exception = SessionMessage(
                        mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False))
                except ValueError as err:  # the session reports it; the log says which line
                    log.warning("MCP server pid %d wrote a line that is not JSON-RPC: %.200r", proc.pid, line)
                    item = err
                try:
                    await to_session.send(item)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return

    async def session_to_child() -> None:
        async with to_child:
            async for message in to_child:
                data = message.message.model_dump_json(by_alias=True, exclude_unset=True).encode() + b"\n"
                try:
                    proc.stdin.write(data)
                    await proc.stdin.drain()
                except (BrokenPipeError, ConnectionResetError) as err:
                    conn.lose(f"the server's stdin is closed ({err})")
                    return

    async def watch_exit() -> None:
        # returncode, not proc.wait(): on 3.11 wait() also waits for the pipes to close, which a
        # grandchild holding the server's stdout delays indefinitely.
        while proc.returncode is None:
            await asyncio.sleep(_EXIT_WATCH_S)
        conn.lose("the server process exited")

    async with anyio.create_task_group() as tg:
        tg.start_soon(child_to_session)
        tg.start_soon(session_to_child)
        tg.start_soon(watch_exit)
        try:
            yield session_reads, session_writes
        finally:
            tg.cancel_scope.cancel()


# -- helpers ---------------------------------------------------------------------------------------


async def _list_all_tools(client: Client) -> list[mcp_types.Tool]:
    tools: list[mcp_types.Tool] = []
    cursor = None
    for _ in range(_MAX_LIST_PAGES):
        page = await client.list_tools(cursor=cursor)
        tools += page.tools
        cursor = page.next_cursor
        if cursor is None:
            return tools
    raise McpStartError(f"tools/list still had more pages after {_MAX_LIST_PAGES}")


def _tool_result(result: mcp_types.CallToolResult, latency_s: float) -> McpToolResult:
    if result.is_error:
        message = _joined_text(result.content) or "the tool reported an error without a message"
        return McpToolResult(None, False, latency_s, message, E_TOOL)
    if result.structured_content is not None:
        return McpToolResult(result.structured_content, True, latency_s)
    return McpToolResult(_joined_text(result.content), True, latency_s)


def _joined_text(blocks: list) -> str:
    return "\n".join(_block_text(b) for b in blocks)


def _block_text(block) -> str:
    """A content block as text the model can read (non-text blocks: a placeholder with type and size)."""
    kind = getattr(block, "type", None)
    if kind == "text":
        return block.text
    if kind in ("image", "audio"):
        return f"[{kind}: {block.mime_type}, {len(block.data) * 3 // 4} bytes]"
    if kind == "resource":
        inner = block.resource
        if getattr(inner, "text", None) is not None:
            return inner.text
        return f"[resource {inner.uri}: {inner.mime_type or 'binary'}, {len(inner.blob) * 3 // 4} bytes]"
    if kind == "resource_link":
        return f"[resource link: {block.uri}]"
    return block.model_dump_json(by_alias=True, exclude_none=True)


def _failed(start: float, error_type: str, message: str) -> McpToolResult:
    return McpToolResult(None, False, time.perf_counter() - start, message, error_type)


def _describe_error(err: BaseException) -> str:
    """The first leaf of an exception group (the SDK's task groups wrap transport errors), as text."""
    while isinstance(err, BaseExceptionGroup) and err.exceptions:
        err = err.exceptions[0]
    return f"{type(err).__name__}: {err}"


def _default_log_path(name: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return str(Path(tempfile.gettempdir()) / "agentrl-mcp" / f"{safe}.{os.getpid()}.log")


def _file_tail(path: str, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(max(offset, f.seek(0, os.SEEK_END) - _STDERR_TAIL_BYTES))
        return f.read().decode(errors="replace").strip()


async def _wait_exit(proc: asyncio.subprocess.Process, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while proc.returncode is None:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_EXIT_POLL_S)
    return True


async def _wait_group_exit(proc: asyncio.subprocess.Process, timeout_s: float) -> bool:
    """Wait until the child has exited and its process group has no live member."""
    deadline = time.monotonic() + timeout_s
    while proc.returncode is None or live_group_members(proc.pid):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_EXIT_POLL_S)
    return True
