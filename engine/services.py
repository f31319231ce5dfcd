"""The actor side's services: start what a run does not point at, connect to all of it.

Tools come from three places, all added together (none replaces another):
- the environment's `required_tools` and `[services] tools`: built-in services (search over the
  task set's corpus, the python sandbox, the calculator), started here;
- `[[tools]]` entries (`ToolSource`): a built-in by name; your own tool service started here from
  a command (it must print `READY <endpoint>`; "{bind}" in the command becomes a free endpoint of
  the host it runs on); running endpoints elsewhere (`tcp://HOST:PORT`, CurveZMQ keys for non-loopback
  hosts); in-process Python functions (`package.module:function`, schema from type hints and
  docstring, or given); MCP servers (stdio command or streamable-HTTP URL);
- `[services] tool_endpoints` / `--tool-endpoint`: running services, grouped by the tools each
  describes (replicas of one service describe the same).

`start_services(...)` starts every process it needs as a child owned by PID (user tool commands
first: one that exits at start is reported, naming its `tools[i]` entry, before a vLLM server is
started) and a vLLM server unless `[services] vllm` lists running ones; `Services.stop()` stops
what was started (never what was given).

`Connections` (an async context) is what the orchestrator runs on: the server pool, the chat
format of the policy's tokenizer, and the environment (`[env] class`) with every tool registered.
`agentrl train` (the supervisor and its actor process) and `agentrl eval` / `rollout` all use these.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Tag

from agentrl.common.config import ConfigError, FilePath, PluginRef, config_dataclass
from agentrl.common.procs import ChildStartError
from agentrl.engine.env import EnvConfig
from agentrl.toolservers.functions import CURVE_AUTHORIZED_CLIENTS_ENV, CURVE_SECRET_KEY_ENV
from agentrl.toolservers.sandbox import SandboxConfig

BUILTIN_TOOLS = ("search", "python", "calculator")
Builtin = Literal["search", "python", "calculator"]


@config_dataclass
class ServingConfig:
    """How a vLLM server the run starts serves (engine/serve.py, VLLMServerConfig)."""

    lora: Literal["merge", "vllm"] = "merge"
    """With LoRA on (learner.trainer.lora.rank > 0), how the server serves the adapter. "merge": each
    adapter push is merged into the base weights the server holds and the model reloaded, so it
    decodes at full speed (agentrl.common.vllm_ext). "vllm": vLLM's own LoRA path (`--enable-lora`),
    every request naming the adapter and every push reloading it in place; the path for GPUs, where
    its kernels make LoRA cheap. On CPU it decoded 47.9 tokens/s against 188.3 for the base model
    (32 requests x 64 tokens, AVX-512 BF16, benchmarks/lora.py), so "merge" is the default."""
    max_lora_rank: int | None = None
    """With lora = "vllm", the server's `--max-lora-rank` (one of vLLM's 1, 8, 16, 32, 64, 128, 256,
    320, 512; at least the adapter's rank); None: the smallest that holds the adapter."""

    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "auto"
    """Serving dtype ("auto": bf16 where the device runs it natively, else float32)."""
    gpu_memory_utilization: float | None = None
    """Fraction of device memory for weights and KV cache; None: 0.15 on CPU, 0.9 on CUDA."""
    kv_cache_gib: float | None = None
    """KV cache, GiB; None: 2.5 on CPU, vLLM's own sizing on CUDA."""
    max_model_len: int = 4096
    """Longest sequence it serves, tokens; must hold env.max_total_tokens."""

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len: {self.max_model_len} must be >= 1")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: {self.gpu_memory_utilization} must be in (0, 1]")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib: {self.kv_cache_gib} must be > 0")
        from agentrl.common.adapters import VLLM_MAX_LORA_RANKS

        if self.max_lora_rank is not None and self.max_lora_rank not in VLLM_MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank: {self.max_lora_rank} is not one vLLM takes; use one of {list(VLLM_MAX_LORA_RANKS)}")


@config_dataclass
class ServicesConfig:
    vllm: list[str] = field(default_factory=list)
    """Running vLLM servers (base URLs, e.g. from `agentrl serve-model`); empty: start one."""
    tool_endpoints: list[str] = field(default_factory=list)
    """Running tool services (ZeroMQ endpoints, tcp://HOST:PORT), added to the tools started here."""
    tools: list[Builtin] = field(default_factory=lambda: ["search", "python", "calculator"])
    """Built-in tool services to start (besides those the environment requires)."""
    search_replicas: int = 1
    """Replicas of the search service to start (>= 1)."""
    vllm_server: ServingConfig = field(default_factory=lambda: ServingConfig())
    """How a vLLM server started here serves (not used with `vllm` URLs)."""
    vllm_replicas: int = 1
    """vLLM servers to start (>= 1; not with `vllm` URLs), each serving the whole policy: episodes are
    spread over them (the actor's server pool), every weight push goes to all of them. Under the
    Ray launcher they are spread over the nodes of the inference kind (Ray's SPREAD: best effort).
    On one host they share its memory and GPUs: size `vllm_server.kv_cache_gib` /
    `gpu_memory_utilization` so that all of them fit."""
    max_learner_restarts: int = 3
    """A learner that dies is restarted (it resumes from its checkpoint) at most this many times."""
    max_tool_restarts: int = 10
    """Tool service processes this run started that die are started again at their endpoints, at
    most this many times in all (their calls go to other replicas, or fail as tool errors the model
    sees, meanwhile); one more death stops the run."""
    max_server_restarts: int = 3
    """A vLLM server this run started that dies is started again at its URL at most this many times
    (the learner pushes it the latest weights when it answers; episodes wait for it meanwhile,
    `orchestrator.server_wait_s`); one more death stops the run."""
    python: SandboxConfig = field(default_factory=SandboxConfig)
    """The python tool's sandboxes and limits (sandbox count, memory, processes, CPU, timeouts),
    for the python service started here."""

    __moved__ = {"vllm_dtype": "vllm_server.dtype", "gpu_memory_utilization": "vllm_server.gpu_memory_utilization",
                 "kv_cache_gib": "vllm_server.kv_cache_gib", "max_model_len": "vllm_server.max_model_len"}

    def __post_init__(self) -> None:
        for url in self.vllm:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"vllm: {url!r} is not a base URL; write it as http://HOST:PORT")
        for endpoint in self.tool_endpoints:
            _check_endpoint(endpoint, "tool_endpoints")
        if self.search_replicas < 1:
            raise ValueError(f"search_replicas: {self.search_replicas} must be >= 1")
        if self.vllm_replicas < 1:
            raise ValueError(f"vllm_replicas: {self.vllm_replicas} must be >= 1")
        if self.vllm and self.vllm_replicas != 1:
            raise ValueError(f"vllm_replicas = {self.vllm_replicas} starts servers, and `vllm` names running ones "
                             f"({', '.join(self.vllm)}): the run uses those and starts none; drop one of the two")
        if self.max_learner_restarts < 0:
            raise ValueError(f"max_learner_restarts: {self.max_learner_restarts} must be >= 0")
        if self.max_server_restarts < 0 or self.max_tool_restarts < 0:
            raise ValueError(f"max_server_restarts ({self.max_server_restarts}) and max_tool_restarts "
                             f"({self.max_tool_restarts}) must be >= 0")


def _check_endpoint(endpoint: str, key: str) -> None:
    if not endpoint.startswith(("tcp://", "ipc://")):
        raise ValueError(f"{key}: {endpoint!r} has no scheme; write it as tcp://HOST:PORT")


@config_dataclass
class BuiltinSource:
    """A built-in tool service, started by the run."""

    builtin: Builtin
    """Which one."""
    replicas: int = 1
    """Instances to start."""
    args: list[str] = field(default_factory=list)
    """Extra command-line options of the service (`agentrl toolserver NAME --help`, e.g.
    ["--workers", "2"]); they win over `[services.python]`."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas: {self.replicas} must be >= 1")


@config_dataclass
class CommandSource:
    """Your own tool service, started by the run from a command."""

    command: list[str]
    """Its argv (run with this Python: a first element "python" is this interpreter); "{bind}" is
    replaced by a free endpoint on the run's `network.host` (loopback by default; off loopback the
    service gets CurveZMQ certificate files in AGENTRL_CURVE_SECRET_KEY /
    AGENTRL_CURVE_AUTHORIZED_CLIENTS, which agentrl.toolservers.functions.serve uses). It must print
    `READY <endpoint>` (serve does) and stop on SIGTERM."""
    replicas: int = 1
    """Instances to start."""
    cwd: FilePath | None = None
    """The folder it runs in. Not given: the folder of the config file that names the command (its
    relative file arguments are taken from there), else the working directory."""

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("command: an empty command")
        if self.replicas < 1:
            raise ValueError(f"replicas: {self.replicas} must be >= 1")


@config_dataclass
class EndpointsSource:
    """A running tool service elsewhere."""

    endpoints: list[str]
    """Its replicas' endpoints (tcp://HOST:PORT)."""
    curve_server_key: FilePath | None = None
    """Off loopback: the server's zmq.auth public key file (NAME.key)."""
    curve_client_key: FilePath | None = None
    """Off loopback: this client's zmq.auth secret key file (NAME.key_secret)."""

    def __post_init__(self) -> None:
        for endpoint in self.endpoints:
            _check_endpoint(endpoint, "endpoints")
        if (self.curve_server_key is None) != (self.curve_client_key is None):
            raise ValueError("curve_server_key: CurveZMQ needs both curve_server_key and curve_client_key")


@config_dataclass
class FunctionSource:
    """An in-process Python function as a tool."""

    function: PluginRef
    """"package.module:function" or "path/file.py:function"."""
    name: str | None = None
    """The tool's name (default: the function's)."""
    description: str | None = None
    """The tool's description (default: its docstring's first paragraph)."""
    parameters: dict[str, Any] | None = None
    """The tool's argument schema (default: from its type hints and docstring)."""


@config_dataclass
class McpSource:
    """An MCP server over stdio, started by the run."""

    mcp: list[str]
    """Its command and arguments."""
    cwd: FilePath | None = None
    """The folder it runs in (default as for `command`)."""

    def __post_init__(self) -> None:
        if not self.mcp:
            raise ValueError("mcp: an empty command")


@config_dataclass
class McpUrlSource:
    """An MCP server over streamable HTTP."""

    mcp_url: str
    """Its URL."""


TOOL_SOURCES: dict[str, type] = {"builtin": BuiltinSource, "command": CommandSource, "endpoints": EndpointsSource,
                                 "function": FunctionSource, "mcp": McpSource, "mcp_url": McpUrlSource}
"""The kinds of `[[tools]]` entry, by the key that says which kind an entry is."""


def _tool_source_kind(value: Any) -> str | None:
    """The kind of a `[[tools]]` table (the one kind key it has) or instance; None when unclear."""
    if isinstance(value, dict):
        present = [key for key in TOOL_SOURCES if key in value]
        return present[0] if len(present) == 1 else None
    return next((key for key, cls in TOOL_SOURCES.items() if isinstance(value, cls)), None)


ToolSource = Annotated[
    Union[tuple(Annotated[cls, Tag(key)] for key, cls in TOOL_SOURCES.items())],  # noqa: UP007 - built from a tuple
    Discriminator(_tool_source_kind, custom_error_type="tool_source",
                  custom_error_message=f"a [[tools]] entry names exactly one of {', '.join(TOOL_SOURCES)}"),
]
"""One `[[tools]]` entry: a tagged union whose tag is the one kind key the table has."""
LOCAL_SOURCES = (FunctionSource, McpSource, McpUrlSource)
"""The kinds built in each process that connects (not services started here)."""


@config_dataclass
class RemoteService:
    """A tool service the actor side connects to (started here or given)."""

    name: str
    endpoints: list[str]
    curve_server_key: str | None = None
    curve_client_key: str | None = None


@dataclass(frozen=True)
class ToolServiceKeys:
    """CurveZMQ certificate files of the tool services a run starts off loopback: the services'
    own (`server_secret`) and the folder of the clients they admit, and the client side's pair."""

    server_secret: str
    authorized_clients: str
    server_public: str
    client_secret: str


@dataclass
class Services:
    """The running services a run connects to, and the processes started for them."""

    vllm_urls: list[str]
    remote: list[RemoteService] = field(default_factory=list)
    local: list[ToolSource] = field(default_factory=list)
    """In-process tools (functions, MCP servers), built in each process that connects."""
    procs: list = field(default_factory=list)
    vllm_servers: list = field(default_factory=list)
    """The launcher's slots of the vLLM servers started here (none with given `vllm` URLs)."""
    vllm_model: str = ""
    """The `model` requests to the servers name: the policy adapter's name when they serve it with
    vLLM's LoRA path (`vllm_server.lora = "vllm"`); empty: the servers' base model."""

    def exited(self) -> list[tuple[Any, int]]:
        """The processes started here that are no longer running, with their exit codes (a slot whose
        host was lost reads the launcher's code for that)."""
        started = [*self.procs, *self.vllm_servers]
        return [(slot, code) for slot in started if (code := slot.poll()) is not None]

    def move(self, old: str, new: str) -> None:
        """A server or tool replica started again at another address: `new` replaces `old` everywhere."""
        self.vllm_urls = [new if url == old else url for url in self.vllm_urls]
        for service in self.remote:
            service.endpoints = [new if e == old else e for e in service.endpoints]

    def directory(self) -> dict[str, list[str]]:
        """The entries of the run's service directory for these services (agentrl.common.directory)."""
        from agentrl.common.directory import INFERENCE, tools_key

        return {INFERENCE: list(self.vllm_urls), **{tools_key(s.name): list(s.endpoints) for s in self.remote}}

    def stop(self) -> None:
        """Stop what was started here, by PID (given endpoints are left running)."""
        for proc in reversed(self.procs):
            proc.stop(timeout_s=10)
        for server in self.vllm_servers:
            server.stop()


def builtin_tools(env_required: tuple[str, ...], config: ServicesConfig, tools: list[ToolSource]) -> list[str]:
    """The built-in services to start, in a stable order, each once."""
    wanted = {*env_required, *config.tools, *(t.builtin for t in tools if isinstance(t, BuiltinSource))}
    unknown = sorted(wanted - set(BUILTIN_TOOLS))
    if unknown:
        raise ConfigError(f"env.class requires tool service(s) {unknown}, which are not built in ({', '.join(BUILTIN_TOOLS)})")
    return [name for name in BUILTIN_TOOLS if name in wanted]


async def start_services(config: ServicesConfig, *, tools: list[ToolSource], env_required: tuple[str, ...],
                         model_dir: str, corpus: Path | None, logs: Path, say=print, start_vllm: bool = True,
                         host: str = "127.0.0.1", control_token: str | None = None,
                         tool_keys: ToolServiceKeys | None = None, launcher=None,
                         served_adapter: Path | None = None) -> Services:
    """Start the tool services and (unless `start_vllm` is False: `agentrl check`) the vLLM server
    the config does not point at, all bound to `host`. Off loopback the vLLM server needs a control
    token (`control_token`, else AGENTRL_CONTROL_TOKEN in this environment) and the tool services
    CurveZMQ certificates (`tool_keys`): built-in services get them as options, `[[tools]] command`
    services in CURVE_SECRET_KEY_ENV / CURVE_AUTHORIZED_CLIENTS_ENV, and the clients the client
    side's pair. On failure every process started so far is stopped before the error propagates.

    `launcher` places each process (agentrl/launch/): None is this host (`LocalLauncher(host)`); under
    a cluster launcher each binds its own node's address, and `host` is the driver's (off loopback).

    `served_adapter`: the servers serve the policy as a LoRA adapter with vLLM's own LoRA path
    (`vllm_server.lora = "vllm"`): the server started here starts with this peft folder as its
    adapter (agentrl.common.adapters.POLICY_ADAPTER), and every request names it, given servers'
    too (they must serve an adapter of that name)."""
    from agentrl.common.control_auth import is_loopback
    from agentrl.engine.roles import LocalLauncher, VLLMRole
    from agentrl.engine.serve import VLLMServerConfig, split_cores, vllm_is_cpu_build

    launcher = launcher or LocalLauncher(host)

    if not is_loopback(host) and tool_keys is None:
        raise ConfigError(f"network.host = {host!r}: tool services bound off loopback need CurveZMQ certificates "
                          "(`agentrl train` makes them under RUN_DIR/curve/)")
    curve = ToolCurve(host, tool_keys)
    logs.mkdir(parents=True, exist_ok=True)
    services = Services(vllm_urls=list(config.vllm), local=[t for t in tools if isinstance(t, LOCAL_SOURCES)])
    lora_args = {}
    if served_adapter is not None:
        from agentrl.common.adapters import POLICY_ADAPTER, adapter_folder_rank, vllm_max_lora_rank

        services.vllm_model = POLICY_ADAPTER
        lora_args = {"lora_adapter": str(served_adapter),
                     "max_lora_rank": config.vllm_server.max_lora_rank or vllm_max_lora_rank(adapter_folder_rank(served_adapter))}
    try:
        for i, source in enumerate(tools):  # user services first: a broken one stops the run before vLLM starts
            if isinstance(source, CommandSource):
                endpoints = []
                for r in range(source.replicas):
                    proc = await asyncio.to_thread(_start_command, source.command, logs / f"tool-command{i}-{r}.log",
                                                   f"tools[{i}]", source.cwd, curve, launcher)
                    services.procs.append(proc)
                    endpoints.append(proc.endpoint)
                    say(f"tool service tools[{i}] #{r}: {proc.endpoint}{proc.where} (pid {proc.pid})")
                services.remote.append(curve.remote(f"tools[{i}]", endpoints))
            elif isinstance(source, EndpointsSource):
                services.remote.append(RemoteService(f"tools[{i}]", list(source.endpoints), source.curve_server_key,
                                                     source.curve_client_key))
        if config.tool_endpoints:
            for name, endpoints in (await group_tool_endpoints(config.tool_endpoints)).items():
                services.remote.append(RemoteService(name, endpoints))
        for name in builtin_tools(env_required, config, tools):
            if name == "search" and corpus is None:
                raise ConfigError("the search tool needs a passage corpus, and this task set provides none "
                                  "(the loader's `corpus` option)")
            source = next((t for t in tools if isinstance(t, BuiltinSource) and t.builtin == name), None)
            args = [*(["--corpus", str(corpus)] if name == "search" else []),
                    *(["--config", _write_service_config(logs / "tool-python.toml", "python", config.python)]
                      if name == "python" else []),
                    *(source.args if source else [])]
            replicas = source.replicas if source else (config.search_replicas if name == "search" else 1)
            endpoints = []
            for r in range(replicas):
                proc = await asyncio.to_thread(_start_builtin, name, args, logs / f"tool-{name}-{r}.log", curve, launcher)
                services.procs.append(proc)
                endpoints.append(proc.endpoint)
                say(f"tool service {name} #{r}: {proc.endpoint}{proc.where} (pid {proc.pid})")
            services.remote.append(curve.remote(name, endpoints))
        if not services.vllm_urls and start_vllm:
            server_config = VLLMServerConfig(model_dir=model_dir, host=host, dtype=config.vllm_server.dtype,
                                             max_model_len=config.vllm_server.max_model_len,
                                             gpu_memory_utilization=config.vllm_server.gpu_memory_utilization,
                                             kv_cache_gib=config.vllm_server.kv_cache_gib, **lora_args)
            names = ["vllm"] if config.vllm_replicas == 1 else [f"vllm-{r}" for r in range(config.vllm_replicas)]
            services.vllm_servers = [launcher.place(name, "inference") for name in names]
            # Servers that share this host share its cores out (on other hosts, each has its node's).
            cores = split_cores(len(names)) if isinstance(launcher, LocalLauncher) and vllm_is_cpu_build() else [None] * len(names)
            say(f"starting {len(names)} vLLM server{'s' * (len(names) > 1)} (log {logs / names[0]}.log"
                f"{', ...' * (len(names) > 1)}) ...")
            # Every start is waited for, failed or not, before the `except` below stops them all.
            results = await asyncio.gather(*(asyncio.to_thread(slot.start, VLLMRole(slot.name, replace(server_config, cpu_cores=core),
                                                                                   str(logs / f"{slot.name}.log"), control_token))
                                             for slot, core in zip(services.vllm_servers, cores, strict=True)),
                                           return_exceptions=True)
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            if failed is not None:
                raise failed
            for slot in services.vllm_servers:
                say(f"vLLM server: {slot.endpoint}{slot.where} (pid {slot.pid})")
            services.vllm_urls = [slot.endpoint for slot in services.vllm_servers]
    except BaseException:
        await asyncio.to_thread(services.stop)
        raise
    return services


def _write_service_config(path: Path, table: str, config: Any) -> str:
    """A built-in service's typed config as the TOML file its `--config` reads."""
    from agentrl.common.config import dump_toml, to_dict

    path.write_text(dump_toml({table: to_dict(config)}))
    return str(path)


@dataclass(frozen=True)
class ToolCurve:
    """Where the tool services started here bind, and the certificates they and their clients use."""

    host: str
    keys: ToolServiceKeys | None

    def server_options(self) -> list[str]:
        """The options of `agentrl toolserver` that switch CurveZMQ on ([] without keys)."""
        if self.keys is None:
            return []
        return ["--curve-secret-key", self.keys.server_secret, "--curve-authorized-clients", self.keys.authorized_clients]

    def server_env(self) -> dict[str, str]:
        """What a command service's environment adds to its host's: the certificate files' paths."""
        if self.keys is None:
            return {}
        return {CURVE_SECRET_KEY_ENV: self.keys.server_secret, CURVE_AUTHORIZED_CLIENTS_ENV: self.keys.authorized_clients}

    def remote(self, name: str, endpoints: list[str]) -> RemoteService:
        if self.keys is None:
            return RemoteService(name, endpoints)
        return RemoteService(name, endpoints, self.keys.server_public, self.keys.client_secret)


def _start_builtin(name: str, args: list[str], log_path: Path, curve: ToolCurve, launcher):
    """A built-in tool service placed by `launcher`, bound on its host to a port the OS picks there."""
    from agentrl.engine.roles import CommandRole, agentrl_argv
    from agentrl.toolservers.process import ToolServerStartError

    slot = launcher.place(log_path.stem, "tools")
    argv = agentrl_argv("toolserver", name, "--bind", "tcp://{host}:*", *curve.server_options(), *args)
    try:
        return slot.start(CommandRole(log_path.stem, argv, str(log_path), ready_prefix="READY "))
    except ChildStartError as err:
        raise ToolServerStartError(str(err)) from None


class ToolCommandError(ConfigError):
    """A user tool service that could not start (it exited, or printed no READY line)."""


def _start_command(command: list[str], log_path: Path, key: str, cwd: str | None, curve: ToolCurve, launcher):
    """A `[[tools]] command` service placed by `launcher`; its "{bind}" is a free port of its host."""
    from agentrl.engine.roles import CommandRole

    check_command(command, f"{key}.command", cwd, ToolCommandError)
    slot = launcher.place(log_path.stem, "tools")
    role = CommandRole(key, (find_program(command[0], cwd), *command[1:]), str(log_path), env=curve.server_env(),
                       ready_prefix="READY ", cwd=cwd)
    try:
        return slot.start(role)
    except ChildStartError as err:
        raise ToolCommandError(f"{key}.command {' '.join(command)!r} did not start: {err}") from None


async def group_tool_endpoints(endpoints: list[str]) -> dict[str, list[str]]:
    """Group given endpoints into services by the tool names each describes (replicas agree)."""
    from agentrl.toolservers.client import ToolClient

    grouped: dict[str, list[str]] = {}
    for endpoint in endpoints:
        async with ToolClient([endpoint]) as client:
            names = sorted(spec["function"]["name"] for spec in await client.describe())
        grouped.setdefault(",".join(names), []).append(endpoint)
    return grouped


def function_tool(source: FunctionSource, key: str):
    """The in-process tool of a `function` entry (ConfigError naming `key` when it cannot be had)."""
    from agentrl.engine.plugins import resolve
    from agentrl.engine.tools import FunctionTool
    from agentrl.toolservers.functions import SchemaError

    fn = resolve(source.function, f"{key}.function")
    if not callable(fn):
        raise ConfigError(f"{key}.function: {source.function!r} is not callable")
    try:
        return FunctionTool.from_function(fn, name=source.name, description=source.description, parameters=source.parameters)
    except SchemaError as err:
        raise ConfigError(f"{key}.function: no usable schema: {err}") from None


def find_program(name: str, cwd: str | None = None) -> str | None:
    """A command's program: a file (relative to `cwd`, the folder the command runs in), on PATH,
    or beside this interpreter (a console script of this environment, such as `mcp-server-time`,
    when the environment's bin folder is not on PATH); "python" is this interpreter."""
    import shutil
    import sys

    if name in ("python", "python3"):
        return sys.executable
    if (Path(cwd or ".") / name).is_file():
        return str(Path(cwd or ".") / name)
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    return found


def check_tool_sources(tools: list[ToolSource]) -> None:
    """What can be checked before anything starts: functions import and have a schema, commands
    name a program that exists."""
    for i, source in enumerate(tools):
        if isinstance(source, FunctionSource):
            function_tool(source, f"tools[{i}]")
        elif isinstance(source, CommandSource):
            check_command(source.command, f"tools[{i}].command", source.cwd)
        elif isinstance(source, McpSource):
            check_command(source.mcp, f"tools[{i}].mcp", source.cwd)


INTERPRETERS = ("python", "python3", "bash", "sh")


def check_command(argv: list[str], key: str, cwd: str | None, error: type[ConfigError] = ConfigError) -> None:
    """The program exists, and so does the script an interpreter is given (`python tools.py`,
    `bash run.sh`: the first argument, when it is not an option), taken from `cwd` (the config
    file's folder, unless the entry sets `cwd`) when relative."""
    where = f" in {cwd}" if cwd else f" (relative paths given with --set are taken from the working directory {Path.cwd()})"
    if find_program(argv[0], cwd) is None:
        raise error(f"{key}: no such program {argv[0]!r}" + (where if "/" in argv[0] else ""))
    script = argv[1] if Path(argv[0]).name in INTERPRETERS and len(argv) > 1 and not argv[1].startswith("-") else None
    if script is not None and not (Path(cwd or ".") / script).is_file():
        raise error(f"{key}: no such file {script!r}{where}; fix the path (relative paths in a config file are "
                    "taken from the file's folder)")


class Connections:
    """Clients of the running services and the environment over their tools (an async context)."""

    def __init__(self, vllm_urls: list[str], remote: list[RemoteService], model_dir: str, env_config: EnvConfig,
                 local: list[ToolSource] | None = None, *, model: str | None = None, server_wait_s: float = 0.0):
        self.vllm_urls, self.remote, self.model_dir, self.env_config = vllm_urls, remote, model_dir, env_config
        self.server_wait_s = server_wait_s
        """With every server down, how long a request waits for one to come back (ServerPool.no_server_wait_s)."""
        self.model = model
        """The `model` the servers' requests name (Services.vllm_model); None: their base model."""
        self.local = local or []
        self._stack = contextlib.AsyncExitStack()
        self.mcp_servers: list = []
        """The MCP servers these connections started (stdio children) or connected to."""
        self.tool_clients: dict = {}
        """Tool service name -> its ToolClient (its replicas' endpoints can move: ToolClient.move)."""

    async def __aenter__(self) -> Connections:
        from transformers import AutoTokenizer

        from agentrl.engine.chat import ChatFormat
        from agentrl.engine.environments import make_env
        from agentrl.engine.pool import ServerPool
        from agentrl.engine.tools import remote_tools
        from agentrl.toolservers.client import ToolClient

        await self._stack.__aenter__()
        try:
            # No server: the tools and the environment only (`agentrl check`).
            self.pool = await self._stack.enter_async_context(ServerPool(self.vllm_urls, model=self.model, no_server_wait_s=self.server_wait_s)) if self.vllm_urls else None
            self.chat = ChatFormat(AutoTokenizer.from_pretrained(self.model_dir))
            self.env = make_env(self.chat, self.env_config)
            self.tools = []
            for service in self.remote:
                client = await self._stack.enter_async_context(ToolClient(service.endpoints, **tool_client_keys(service)))
                self.tool_clients[service.name] = client
                self.tools += await remote_tools(client)
            for i, source in enumerate(self.local):
                if isinstance(source, FunctionSource):
                    self.tools.append(function_tool(source, f"tools[{i}]"))
                else:
                    self.tools += await self._mcp_tools(source, f"tools[{i}]")
            for tool in self.tools:
                self.env.register_tool(tool)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def _mcp_tools(self, source: McpSource | McpUrlSource, key: str) -> list:
        """The tools of an MCP server (its stdio child started and owned here, stopped on exit)."""
        from agentrl.engine.mcp import McpServer, McpServerConfig, McpStartError

        if isinstance(source, McpSource):
            config = McpServerConfig(command=find_program(source.mcp[0], source.cwd) or source.mcp[0], args=tuple(source.mcp[1:]),
                                     name=key, cwd=source.cwd)
        else:
            config = McpServerConfig(url=source.mcp_url, name=key)
        try:
            server = await self._stack.enter_async_context(McpServer(config))
        except McpStartError as err:
            raise ConfigError(f"{key}.{'mcp' if isinstance(source, McpSource) else 'mcp_url'}: the MCP server did not start: {err}") from None
        self.mcp_servers.append(server)
        return list(server.tools)

    def move(self, old: str, new: str) -> None:
        """A server or tool replica started again at another address: the pool or the tool client
        that held `old` follows it to `new` (ServerPool.move, ToolClient.move)."""
        if self.pool is not None and old in [server.client.base_url for server in self.pool.servers]:
            self.pool.move(old, new)
            return
        for client in self.tool_clients.values():
            if old in client.endpoints:
                client.move(old, new)
                return
        raise KeyError(f"no server or tool replica at {old} among these connections")

    async def __aexit__(self, *exc) -> None:
        await self._stack.aclose()


def tool_client_keys(service: RemoteService) -> dict:
    from agentrl.common.curve import load_client_keys

    keys = load_client_keys(service.curve_server_key, service.curve_client_key,
                            names=(f"{service.name}.curve_server_key", f"{service.name}.curve_client_key"))
    if keys is None:
        return {}
    return {"curve_server_public_key": keys.server_public_key, "curve_client_public_key": keys.public_key,
            "curve_client_secret_key": keys.secret_key}
