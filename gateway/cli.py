"""`agentrl gateway`: serve the OpenAI chat API in front of vLLM servers, recording sessions.

    agentrl gateway --port 8100                               # starts its own vLLM server
    agentrl gateway --port 8100 --vllm http://127.0.0.1:8000  # uses running servers (repeatable)

Prints its base URL (`http://HOST:PORT`) on stdout once it serves; logs go to stderr. With --vllm,
the tokenizer comes from --model or else from the folder the first server reports in /v1/models, and
the context limit from --max-model-len or else from that answer. SIGTERM or SIGINT stops the HTTP
server, then the vLLM server it started (by its process group id), and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import urllib.error
import urllib.request
from pathlib import Path

from agentrl.engine.parsers import TOOL_CALL_PARSERS


def _served_model(url: str) -> dict:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=10) as resp:
            return json.loads(resp.read())["data"][0]
    except (urllib.error.URLError, ConnectionError, TimeoutError, KeyError, IndexError, json.JSONDecodeError) as err:
        raise SystemExit(f"agentrl gateway: cannot read {url}/v1/models ({err}); give --model DIR and --max-model-len N") from err


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentrl gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True, help="port to serve on (0: a free one; the URL is printed)")
    p.add_argument("--model", default=None, help="HF model folder: the tokenizer, and the model to serve when no --vllm is given "
                                                 "(default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--vllm", action="append", default=[], metavar="URL", help="a running vLLM server (repeat for several)")
    p.add_argument("--served-model-name", default=None, help="the `model` clients send (default: the model folder's name)")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + completion limit, tokens (default: the server's)")
    p.add_argument("--tool-parser", default="auto", choices=["auto", *TOOL_CALL_PARSERS])
    p.add_argument("--renderer", default="auto", choices=["auto", "chatml", "template"])
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file to use instead of the tokenizer's")
    p.add_argument("--session-idle-s", type=float, default=600.0)
    p.add_argument("--max-sessions", type=int, default=16384)
    p.add_argument("--render-check-every", type=int, default=8,
                   help="re-render one recalled completion in N from its text to count drift (1: all, 0: none)")
    # uvloop runs the gateway's transports and timers in C: benchmarks/gateway.py, alternating runs on
    # this machine, 423 against 528 CPU us per turn (medians of 3, each pair in uvloop's favour).
    p.add_argument("--event-loop", default="uvloop", choices=["uvloop", "asyncio"])
    p.add_argument("--dtype", default="auto", help="for the vLLM server the gateway starts (auto: bf16 where the device runs it natively, else float32)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="for the vLLM server the gateway starts")
    p.add_argument("--vllm-log", default=None, help="log file of the vLLM server the gateway starts")
    p.add_argument("--adapter", default=None, metavar="NAME",
                   help="the LoRA adapter the --vllm servers serve the policy as (vLLM's LoRA path; agentrl's runs name it "
                        "'policy'): every request names it")
    return p


def main(argv: list[str]) -> int:
    from agentrl.common.procs import exit_on_sigterm

    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    exit_on_sigterm()  # a SIGTERM while the vLLM server starts still runs the `finally` that stops it
    if args.vllm:
        served = _served_model(args.vllm[0]) if args.model is None or args.max_model_len is None else {}
        model_dir = args.model or served.get("root") or served.get("id")
        if not (Path(model_dir) / "tokenizer_config.json").is_file():
            raise SystemExit(f"agentrl gateway: {args.vllm[0]} serves {model_dir!r}, not a local folder here; give --model DIR (its tokenizer)")
        max_model_len = args.max_model_len or int(served["max_model_len"])
    else:
        from agentrl.common.model import resolve_model

        model_dir = str(resolve_model(args.model))
        max_model_len = args.max_model_len or 4096
    from agentrl.common.config import ConfigError, from_options
    from agentrl.gateway.config import GatewayConfig

    try:  # checked before any server starts
        config = from_options(GatewayConfig, "agentrl gateway", host=args.host, port=args.port,
                              served_model_name=args.served_model_name, max_model_len=max_model_len,
                              tool_parser=args.tool_parser, renderer=args.renderer, session_idle_s=args.session_idle_s,
                              max_sessions=args.max_sessions, render_check_every=args.render_check_every)
    except ConfigError as err:
        raise SystemExit(str(err)) from err
    server = None
    try:
        if args.vllm:
            urls = list(args.vllm)
        else:
            from agentrl.engine.serve import VLLMServer, VLLMServerConfig

            server = VLLMServer(VLLMServerConfig(model_dir=model_dir, dtype=args.dtype, max_model_len=max_model_len,
                                                 gpu_memory_utilization=args.gpu_memory_utilization), log_path=args.vllm_log)
            print(f"starting vLLM server (log {server.log_path})", file=sys.stderr, flush=True)
            urls = [server.start()]
            print(f"started vLLM server pid {server.pid} at {urls[0]}", file=sys.stderr, flush=True)
        serve = _serve(config, model_dir, urls, args.chat_template, args.adapter)
        if args.event_loop == "uvloop":
            import uvloop

            uvloop.run(serve)
        else:
            asyncio.run(serve)
    finally:
        if server is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the stop short
            server.stop()
    return 0


async def _serve(config, model_dir: str, urls: list[str], chat_template: str | None, adapter: str | None = None) -> None:
    from transformers import AutoTokenizer

    from agentrl.engine.pool import ServerPool
    from agentrl.gateway.server import Gateway

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if chat_template is not None:
        tokenizer.chat_template = Path(chat_template).read_text()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with ServerPool(urls, model=adapter) as pool:
        gateway = Gateway(config, tokenizer, pool, model_dir=model_dir)
        base_url = await gateway.start()
        print(base_url, flush=True)
        try:
            await stop.wait()
        finally:
            await gateway.stop()
    logging.getLogger(__name__).info("gateway stopped (%d sessions were open)", len(gateway.sessions))
