"""`agentrl tool call|describe ...`: call or describe a running tool service or an MCP server.

    agentrl tool call --endpoint tcp://127.0.0.1:5601 --tool calculator --args '{"expression": "1/3+1"}'
    agentrl tool describe --endpoint tcp://127.0.0.1:5601
    agentrl tool describe --mcp "mcp-server-time --local-timezone UTC"         # an MCP server over stdio
    agentrl tool call --mcp-url http://127.0.0.1:8000/mcp --tool add --args '{"a": 1, "b": 2}'

`tool call` prints one JSON line, `{"ok": true, "content": ...}` or `{"ok": false, "error":
{"type", "message"}}`, and exits 0 whenever the service answered; it exits 1 when no replica
answered and 2 on bad usage. `--mcp COMMAND` (started for the one call, stopped by PID after it)
and `--mcp-url URL` do the same with an MCP server (engine/mcp.py); 1 then means it could not be
started or connected to. It lives in the engine (not toolservers/) because it speaks to both kinds
of tool host: the engine may import toolservers, not the other way round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile


def _client_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="agentrl tool", description="Call or describe a running tool service.")
    sub = ap.add_subparsers(dest="action", required=True)
    for action in ("call", "describe"):
        p = sub.add_parser(action)
        where = p.add_mutually_exclusive_group(required=True)
        where.add_argument("--endpoint", action="append", help="a replica; repeat for several")
        where.add_argument("--mcp", metavar="COMMAND", help='an MCP server over stdio, e.g. "mcp-server-time"')
        where.add_argument("--mcp-url", metavar="URL", help="an MCP server over streamable HTTP")
        p.add_argument("--mcp-log", metavar="PATH",
                       help="--mcp: append the server's stderr here (default: a temporary file, kept only "
                            "if the server could not be started)")
        p.add_argument("--timeout-s", type=float, default=30.0)
        p.add_argument("--curve-server-key", help="the server's zmq.auth public NAME.key")
        p.add_argument("--curve-client-key", help="this client's zmq.auth NAME.key_secret")
        if action == "call":
            p.add_argument("--tool", required=True)
            p.add_argument("--args", required=True, help="the arguments as a JSON object")
    return ap


def main(argv: list[str]) -> int:
    from agentrl.common.curve import load_client_keys
    from agentrl.toolservers.client import ToolClient, ToolServiceUnavailable

    args = _client_parser().parse_args(argv)
    if args.action == "call":
        try:
            tool_args = json.loads(args.args)
        except json.JSONDecodeError as exc:
            print(f"agentrl tool call: --args is not JSON: {exc}", file=sys.stderr)
            return 2
    if args.mcp is not None or args.mcp_url is not None:
        return _mcp_main(args, tool_args if args.action == "call" else None)
    try:
        keys = load_client_keys(args.curve_server_key, args.curve_client_key,
                                names=("--curve-server-key", "--curve-client-key"))
    except ValueError as exc:
        print(f"agentrl tool: {exc}", file=sys.stderr)
        return 2
    curve = {} if keys is None else dict(curve_server_public_key=keys.server_public_key,
                                         curve_client_public_key=keys.public_key, curve_client_secret_key=keys.secret_key)

    async def run() -> object:
        async with ToolClient(args.endpoint, request_timeout_s=args.timeout_s, **curve) as client:
            if args.action == "describe":
                return await client.describe()
            resp = await client.call(args.tool, tool_args, deadline_s=args.timeout_s)
            if resp.ok:
                return {"ok": True, "content": resp.content}
            assert resp.error is not None
            return {"ok": False, "error": {"type": resp.error.type, "message": resp.error.message}}

    try:
        result = asyncio.run(run())
    except ToolServiceUnavailable as exc:
        print(f"agentrl tool: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result), flush=True)
    return 0


def _mcp_main(args: argparse.Namespace, tool_args: object) -> int:
    from agentrl.engine.mcp import McpServer, McpServerConfig, McpStartError

    if args.curve_server_key or args.curve_client_key:
        print("agentrl tool: CurveZMQ keys apply to --endpoint only", file=sys.stderr)
        return 2
    if args.action == "call" and not isinstance(tool_args, dict):
        print("agentrl tool call: --args must be a JSON object", file=sys.stderr)
        return 2
    try:
        if args.mcp is not None:
            config = McpServerConfig.from_command_line(args.mcp, start_timeout_s=args.timeout_s)
        else:
            config = McpServerConfig(url=args.mcp_url, start_timeout_s=args.timeout_s)
    except ValueError as exc:
        print(f"agentrl tool: {exc}", file=sys.stderr)
        return 2
    temporary_log = config.command is not None and args.mcp_log is None
    if temporary_log:
        fd, config.stderr_log_path = tempfile.mkstemp(prefix=f"agentrl-mcp-{config.name}-", suffix=".log")
        os.close(fd)
    else:
        config.stderr_log_path = args.mcp_log

    async def run() -> object:
        async with McpServer(config) as server:
            if args.action == "describe":
                return [tool.describe() for tool in server.tools]
            result = await server.call(args.tool, tool_args, timeout_s=args.timeout_s)
            if result.success:
                return {"ok": True, "content": result.content}
            return {"ok": False, "error": {"type": result.error_type, "message": result.error}}

    try:
        result = asyncio.run(run())
    except McpStartError as exc:
        print(f"agentrl tool: {exc}", file=sys.stderr)  # names the log, which is kept
        return 1
    if temporary_log:
        os.unlink(config.stderr_log_path)
    print(json.dumps(result), flush=True)
    return 0
