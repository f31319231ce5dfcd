"""The actor side's services: start what a run does not point at, connect to all of it.

`start_services(config, corpus, logs)` starts, as child processes owned by PID, the built-in tool
services named in `[services] tools` (search over the run's corpus, the python sandbox, the
calculator) and a vLLM server unless `[services] vllm` lists running ones; `Services.stop()` stops
what was started (never what was given). Tool endpoints given in `[services] tool_endpoints` are
grouped into services by the tools each describes (replicas of one service describe the same).

`Connections` (an async context) is what the orchestrator runs on: the server pool, the chat
format of the policy's tokenizer, and a `ToolEnv` with every tool of every service registered.
`agentrl train` (the supervisor and its actor process) and `agentrl eval` / `rollout` all use these.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agentrl.common.config import config_dataclass
from agentrl.engine.env import EnvConfig

BUILTIN_TOOLS = ("search", "python", "calculator")


@config_dataclass
class ServicesConfig:
    vllm: list[str] = field(default_factory=list)
    """Running vLLM servers (base URLs, e.g. from `agentrl serve-model`); empty: start one."""
    tool_endpoints: list[str] = field(default_factory=list)
    """Running tool services (ZeroMQ endpoints, tcp://HOST:PORT); empty: start `tools` here."""
    tools: list[Literal["search", "python", "calculator"]] = field(default_factory=lambda: ["search", "python", "calculator"])
    """Built-in tool services to start when `tool_endpoints` is empty."""
    search_replicas: int = 1
    """Replicas of the search service to start (>= 1)."""
    vllm_dtype: Literal["bfloat16", "float16", "float32", "auto"] = "bfloat16"
    """Serving dtype of a vLLM server started here."""
    gpu_memory_utilization: float | None = None
    """Of a vLLM server started here (engine/serve.py); None: its default."""
    kv_cache_gib: float | None = None
    """KV cache of a vLLM server started here, GiB (engine/serve.py); None: 2.5 on CPU."""
    max_model_len: int = 4096
    """Longest sequence a vLLM server started here serves, tokens; must hold env.max_total_tokens."""
    max_learner_restarts: int = 3
    """A learner that dies is restarted (it resumes from its checkpoint) at most this many times."""

    def __post_init__(self) -> None:
        for url in self.vllm:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"vllm: {url!r} is not a base URL; write it as http://HOST:PORT")
        for endpoint in self.tool_endpoints:
            if not endpoint.startswith(("tcp://", "ipc://")):
                raise ValueError(f"tool_endpoints: {endpoint!r} has no scheme; write it as tcp://HOST:PORT")
        if self.search_replicas < 1:
            raise ValueError(f"search_replicas={self.search_replicas} must be >= 1")
        if self.max_model_len < 1 or self.max_learner_restarts < 0:
            raise ValueError("max_model_len must be >= 1 and max_learner_restarts >= 0")


@dataclass
class Services:
    """Endpoints of the running services, and the processes started for them."""

    vllm_urls: list[str]
    tool_endpoints: dict[str, list[str]]
    """Service name (its tool names, comma-joined, for given endpoints) -> replica endpoints."""
    tool_procs: list = field(default_factory=list)
    vllm_server: object | None = None

    def stop(self) -> None:
        """Stop what was started here, by PID (given endpoints are left running)."""
        for proc in self.tool_procs:
            proc.stop(timeout_s=10)
        if self.vllm_server is not None:
            self.vllm_server.stop()


async def start_services(config: ServicesConfig, *, model_dir: str, corpus: Path | None, logs: Path,
                         say=print) -> Services:
    """Start the tool services and the vLLM server the config does not point at. On failure every
    process started so far is stopped before the error propagates."""
    from agentrl.engine.serve import VLLMServer, VLLMServerConfig
    from agentrl.toolservers.process import start_toolserver

    logs.mkdir(parents=True, exist_ok=True)
    services = Services(vllm_urls=list(config.vllm), tool_endpoints={})
    try:
        if config.tool_endpoints:
            services.tool_endpoints = await group_tool_endpoints(config.tool_endpoints)
        else:
            for name in config.tools:
                if name == "search" and corpus is None:
                    raise ValueError("the search tool needs a passage corpus, and these tasks provide none")
                args = ["--corpus", str(corpus)] if name == "search" else []
                for r in range(config.search_replicas if name == "search" else 1):
                    proc = await asyncio.to_thread(start_toolserver, name, "tcp://127.0.0.1:*", *args,
                                                   log_path=str(logs / f"tool-{name}-{r}.log"))
                    services.tool_procs.append(proc)
                    services.tool_endpoints.setdefault(name, []).append(proc.endpoint)
                    say(f"tool service {name} #{r}: {proc.endpoint} (pid {proc.pid})")
        if not services.vllm_urls:
            server = VLLMServer(
                VLLMServerConfig(model_dir=model_dir, dtype=config.vllm_dtype, max_model_len=config.max_model_len,
                                 gpu_memory_utilization=config.gpu_memory_utilization, kv_cache_gib=config.kv_cache_gib),
                log_path=logs / "vllm.log")
            services.vllm_server = server
            say(f"starting vLLM server (log {server.log_path}) ...")
            await asyncio.to_thread(server.start)
            say(f"vLLM server: {server.base_url} (pid {server.pid})")
            services.vllm_urls = [server.base_url]
    except BaseException:
        await asyncio.to_thread(services.stop)
        raise
    return services


async def group_tool_endpoints(endpoints: list[str]) -> dict[str, list[str]]:
    """Group given endpoints into services by the tool names each describes (replicas agree)."""
    from agentrl.toolservers.client import ToolClient

    grouped: dict[str, list[str]] = {}
    for endpoint in endpoints:
        async with ToolClient([endpoint]) as client:
            names = sorted(spec["function"]["name"] for spec in await client.describe())
        grouped.setdefault(",".join(names), []).append(endpoint)
    return grouped


class Connections:
    """Clients of the running services and a ToolEnv over their tools (an async context)."""

    def __init__(self, vllm_urls: list[str], tool_endpoints: dict[str, list[str]], model_dir: str, env_config: EnvConfig):
        self.vllm_urls, self.tool_endpoints, self.model_dir, self.env_config = vllm_urls, tool_endpoints, model_dir, env_config
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Connections:
        from transformers import AutoTokenizer

        from agentrl.engine.chat import ChatFormat
        from agentrl.engine.env import ToolEnv
        from agentrl.engine.pool import ServerPool
        from agentrl.engine.tools import remote_tools
        from agentrl.toolservers.client import ToolClient

        await self._stack.__aenter__()
        try:
            self.pool = await self._stack.enter_async_context(ServerPool(self.vllm_urls))
            self.chat = ChatFormat(AutoTokenizer.from_pretrained(self.model_dir))
            self.env = ToolEnv(self.chat, self.env_config)
            self.tools = []
            for endpoints in self.tool_endpoints.values():
                client = await self._stack.enter_async_context(ToolClient(endpoints))
                for tool in await remote_tools(client):
                    self.env.register_tool(tool)
                    self.tools.append(tool)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self._stack.aclose()
