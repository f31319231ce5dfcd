"""`agentrl toolserver NAME ...`: run one tool service (`agentrl tool ...`, in engine/tool_cli.py, uses one).

    agentrl toolserver calculator --bind tcp://127.0.0.1:5601
    agentrl toolserver search --bind tcp://127.0.0.1:5602 --corpus passages.jsonl [--workers N] [--cache-dir DIR]
    agentrl toolserver python --bind tcp://127.0.0.1:5603 [--workers N] [--memory-mb 1024] ...

A server prints `READY <endpoint>` on stdout once it accepts requests (a supervisor waits for that
line; see process.py) and stops within a bounded time on SIGTERM/SIGINT. `--bind
tcp://127.0.0.1:*` picks a free port; the READY line names it.
"""

from __future__ import annotations

import argparse
import sys

from agentrl.toolservers.server import ServerConfig, Tool, ToolServer, configure_logging

SERVICES = ("calculator", "search", "python")


def _server_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="agentrl toolserver", description="Run one tool service.")
    ap.add_argument("name", choices=SERVICES)
    ap.add_argument("--bind", default="tcp://127.0.0.1:5555", help="ZeroMQ endpoint (loopback by default)")
    ap.add_argument("--workers", type=int, default=None,
                    help="search: scoring threads (default 1); python: pre-started sandboxes (default 4)")
    ap.add_argument("--max-request-bytes", type=int, default=ServerConfig.max_request_bytes,
                    help="largest single request; larger ones are answered request_too_large")
    ap.add_argument("--max-frame-bytes", type=int, default=ServerConfig.max_frame_bytes,
                    help="largest request frame read (ZeroMQ MAXMSGSIZE); a larger one drops the sender")
    ap.add_argument("--max-in-flight", type=int, default=ServerConfig.max_in_flight)
    ap.add_argument("--reply-batch", type=int, default=ServerConfig.reply_batch,
                    help="replies sent after every this many finished calls (pipelining)")
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


def _build_tool(args: argparse.Namespace) -> Tool:
    if args.name == "calculator":
        from agentrl.toolservers.calculator import CalculatorTool

        if args.workers is not None:
            raise ValueError("calculator runs inline on the server loop (~10 us a call); --workers does not "
                             "apply. For more throughput start more replicas and list them all in the client.")

        return CalculatorTool()
    if args.name == "search":
        from agentrl.toolservers.search import SearchConfig, SearchTool

        if not args.corpus:
            raise ValueError("search needs --corpus PATH.jsonl (one {id, title, text} object per line)")
        cfg = SearchConfig(corpus_path=args.corpus, num_threads=args.workers or 1)
        if args.cache_dir:
            cfg.cache_dir = args.cache_dir
        return SearchTool(cfg)
    from agentrl.toolservers.sandbox import PythonTool, SandboxConfig

    cfg = SandboxConfig()
    overrides = {
        "num_workers": args.workers,
        "default_timeout_s": args.default_timeout_s,
        "max_timeout_s": args.max_timeout_s,
        "memory_bytes": args.memory_mb and args.memory_mb << 20,
        "max_processes": args.max_processes,
        "cpu_cores": args.cpu_cores,
        "max_file_bytes": args.max_file_mb and args.max_file_mb << 20,
        "tmpfs_bytes": args.tmpfs_mb and args.tmpfs_mb << 20,
        "max_inodes": args.max_inodes,
        "max_output_bytes": args.max_output_bytes,
    }
    for key, value in overrides.items():
        if value is not None:
            setattr(cfg, key, value)
    cfg.cgroups = not args.no_cgroups
    return PythonTool(cfg)


def serve_main(argv: list[str]) -> int:
    args = _server_parser().parse_args(argv)
    configure_logging(args.log_level)
    config = ServerConfig(
        bind=args.bind,
        max_request_bytes=args.max_request_bytes,
        max_frame_bytes=args.max_frame_bytes,
        max_in_flight=args.max_in_flight,
        reply_batch=args.reply_batch,
        curve_secret_key_file=args.curve_secret_key,
        curve_authorized_clients_dir=args.curve_authorized_clients,
    )
    try:
        config.validate()
        tool = _build_tool(args)
        server = ToolServer(config, [tool])
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"agentrl toolserver {args.name}: {exc}", file=sys.stderr)
        return 2
    server.serve()
    return 0


# --- client side ---------------------------------------------------------------------------------
