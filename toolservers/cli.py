"""`agentrl toolserver NAME ...`: run one tool service (`agentrl tool ...`, in engine/tool_cli.py, uses one).

    agentrl toolserver calculator --bind tcp://127.0.0.1:5601
    agentrl toolserver search --bind tcp://127.0.0.1:5602 --corpus passages.jsonl [--workers N] [--cache-dir DIR]
    agentrl toolserver python --bind tcp://127.0.0.1:5603 [--workers N] [--memory-mb 1024] ...
    agentrl toolserver python --config python.toml   # [server] and [python] tables; options win

Every option is a key of the service's typed config (`ServerConfig`, `SandboxConfig`,
`SearchConfig`), checked as a config file is: a bad value names the option's key and the fix.

A server prints `READY <endpoint>` on stdout once it accepts requests (a supervisor waits for that
line; see process.py) and stops within a bounded time on SIGTERM/SIGINT. `--bind
tcp://127.0.0.1:*` picks a free port; the READY line names it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from agentrl.common.config import ConfigError, build, layer, read_toml
from agentrl.toolservers.server import ServerConfig, Tool, ToolServer, configure_logging

SERVICES = ("calculator", "search", "python")


def _server_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="agentrl toolserver", description="Run one tool service.")
    ap.add_argument("name", choices=SERVICES)
    ap.add_argument("--config", help="TOML file: a [server] table (ServerConfig) and the service's own "
                                     "([python]: SandboxConfig, [search]: SearchConfig); options given here win")
    ap.add_argument("--bind", help="ZeroMQ endpoint (default tcp://127.0.0.1:5555, loopback)")
    ap.add_argument("--workers", type=int, default=None,
                    help="search: scoring threads (default 1); python: pre-started sandboxes (default 4)")
    ap.add_argument("--max-request-bytes", type=int, help="largest single request; larger ones are answered request_too_large")
    ap.add_argument("--max-frame-bytes", type=int,
                    help="largest request frame read (ZeroMQ MAXMSGSIZE); a larger one drops the sender")
    ap.add_argument("--max-in-flight", type=int)
    ap.add_argument("--reply-batch", type=int, help="replies sent after every this many finished calls (pipelining)")
    ap.add_argument("--curve-secret-key", help="this server's zmq.auth NAME.key_secret (needed off loopback)")
    ap.add_argument("--curve-authorized-clients", help="directory of allowed clients' zmq.auth *.key files")
    ap.add_argument("--log-level", default="INFO")
    search = ap.add_argument_group("search")
    search.add_argument("--corpus", help="JSONL of {id, title, text} passages")
    search.add_argument("--cache-dir", help="where built indexes are cached")
    py = ap.add_argument_group("python (sandbox limits)")
    py.add_argument("--default-timeout-s", type=float, help="wall time of a call that names none")
    py.add_argument("--max-timeout-s", type=float, help="largest wall time a call may ask for")
    py.add_argument("--memory-mb", type=int, help="address-space limit per sandboxed process")
    py.add_argument("--max-processes", type=int, help="processes and threads per sandbox, including its 3 own")
    py.add_argument("--cpu-cores", type=float, help="CPU bandwidth of one sandbox, all its processes together")
    py.add_argument("--max-file-mb", type=int, help="largest file a call may write")
    py.add_argument("--tmpfs-mb", type=int, help="size of the sandbox's private /tmp and /dev/shm, each")
    py.add_argument("--max-inodes", type=int, help="files and directories in /tmp and in /dev/shm, each")
    py.add_argument("--max-output-bytes", type=int, help="stdout and stderr kept per call, each")
    py.add_argument("--no-cgroups", action="store_true",
                    help="no per-sandbox memory, pids and cpu cgroups (hosts without writable cgroup v1): "
                         "only per-process rlimits then bound memory, processes and CPU")
    return ap


def _mib(value: int | None) -> int | None:
    return None if value is None else value << 20


def _options(args: argparse.Namespace) -> dict[str, dict]:
    """The command line's options as config tables (only those given)."""
    tables = {
        "server": {"bind": args.bind, "max_request_bytes": args.max_request_bytes, "max_frame_bytes": args.max_frame_bytes,
                   "max_in_flight": args.max_in_flight, "reply_batch": args.reply_batch,
                   "curve_secret_key_file": args.curve_secret_key,
                   "curve_authorized_clients_dir": args.curve_authorized_clients},
        "search": {"corpus_path": args.corpus, "cache_dir": args.cache_dir, "num_threads": args.workers},
        "python": {"num_workers": args.workers, "default_timeout_s": args.default_timeout_s,
                   "max_timeout_s": args.max_timeout_s, "memory_bytes": _mib(args.memory_mb),
                   "max_processes": args.max_processes, "cpu_cores": args.cpu_cores,
                   "max_file_bytes": _mib(args.max_file_mb), "tmpfs_bytes": _mib(args.tmpfs_mb),
                   "max_inodes": args.max_inodes, "max_output_bytes": args.max_output_bytes,
                   "cgroups": False if args.no_cgroups else None},
    }
    return {table: {k: v for k, v in values.items() if v is not None} for table, values in tables.items()}


def service_configs(args: argparse.Namespace) -> tuple[ServerConfig, Any]:
    """The server's config and the service's own (None for the calculator), from `--config` and the
    options given on the command line (which win); a ConfigError names the file or option and key."""
    own = {"calculator": None, "search": "search", "python": "python"}[args.name]
    origins: dict = {}
    data: dict = {}
    if args.config:
        data = layer({}, read_toml(args.config), origins=origins, source=args.config)
        extra = sorted(set(data) - {"server", *([own] if own else [])})
        if extra:
            raise ConfigError(f"{args.config}: table(s) {extra} do not apply to the {args.name} service; "
                              f"it reads [server]{f' and [{own}]' if own else ''}")
    options = _options(args)
    if args.name == "calculator" and args.workers is not None:
        raise ConfigError("calculator runs inline on the server loop (~10 us a call); --workers does not "
                          "apply. For more throughput start more replicas and list them all in the client.")
    data = layer(data, {"server": options["server"], **({own: options[own]} if own else {})},
                 origins=origins, source="the command line")
    server = build(ServerConfig, data.get("server", {}), origins=origins, prefix=("server",))
    if own is None:
        return server, None
    if own == "search":
        from agentrl.toolservers.search import SearchConfig as cls
        if "corpus_path" not in data.get("search", {}):
            raise ConfigError("search needs --corpus PATH.jsonl (one {id, title, text} object per line), "
                              "or corpus_path in the [search] table of --config")
    else:
        from agentrl.toolservers.sandbox import SandboxConfig as cls
    return server, build(cls, data.get(own, {}), origins=origins, prefix=(own,))


def _build_tool(name: str, config: Any) -> Tool:
    if name == "calculator":
        from agentrl.toolservers.calculator import CalculatorTool

        return CalculatorTool()
    if name == "search":
        from agentrl.toolservers.search import SearchTool

        return SearchTool(config)
    from agentrl.toolservers.sandbox import PythonTool

    return PythonTool(config)


def serve_main(argv: list[str]) -> int:
    args = _server_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        config, own = service_configs(args)
        config.check_host()
        tool = _build_tool(args.name, own)
        server = ToolServer(config, [tool])
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"agentrl toolserver {args.name}: {exc}", file=sys.stderr)
        return 2
    server.serve()
    return 0


# --- client side ---------------------------------------------------------------------------------
