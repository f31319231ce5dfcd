"""Hot-swap weights into a running vLLM server, with in-flight requests kept.

A push, in order:
1. (caller's side) the weights are written as safetensors to shared memory (`/dev/shm`), unless the
   caller passes a file; writing there costs no disk I/O. Each process writes into its own
   directory, `agentrl-weights-<pid>` (safetensors' temporary file included), so what a killed
   writer leaves behind is found by its PID: `sweep_weights_dirs` removes the directories of
   processes that no longer run. A writer sweeps on its first write, and `agentrl train` when it
   stops its processes. Before this, each SIGKILLed or early-stopped learner left its weights file
   (538 MB for the 135M model, in RAM) in /dev/shm for good.
   How the file reaches the server is the push's transport (`TRANSPORTS`): `shm` names the file
   (a server on this host reads it), `stream` sends its bytes to the server's /agentrl/weights
   (agentrl/common/server_control.py), which keeps its own copy until it is staged.
2. stage: the server's worker reads and validates the file (names, shapes, finite values) while
   it keeps generating. A refused push stops here: nothing was paused or applied.
3. pause with mode `keep`: running requests freeze in the scheduler. With `recompute_kv` (the
   default) the KV and prefix caches are dropped too, so after the swap every running request
   recomputes its whole context under the new weights (AReaL's choice). Without it, running
   requests keep the keys and values computed so far and continue under the new weights, and the
   prefix cache keeps its blocks (PipelineRL's in-flight update). The second is inexact in a way
   the learner corrects: the behavior log-probs vLLM returns are those of the distribution that
   actually sampled, and the decoupled objective's importance weight uses them. But the version
   labels then understate staleness: the shared prompt's prefix-cache blocks are hit by every
   request and never evicted, so without a periodic full clear new episodes would condition on
   prompt keys from arbitrarily old weights. The learner therefore clears fully every
   `publish.kv_refresh_every` pushes (learner/publish.py), which bounds the age of reused keys to that many
   versions. It matters on CPU: recomputing ~16 in-flight 600-token contexts costs the 2-core
   server ~20 s of prefill per push, more than the time between pushes when an evaluation's 96
   requests are in flight too. Call `reset_kv_cache` before a measurement that must see only the
   new weights (an evaluation).
4. apply: layer-wise reload from the staged tensors (the only reload path that works on the CPU
   worker; about 0.35 s for 135M parameters). On a server that serves the policy as a LoRA adapter
   (vLLM's own LoRA path), the stage wrote the adapter as a peft folder on the server and the apply
   is vLLM's `/v1/load_lora_adapter` with `load_inplace` (requests in flight continue with it).
5. set the weight-version label (the learner step), so tokens sampled from now on carry it.
6. resume. Steps 4-6 run in a `finally` that always resumes, so a failure never leaves the
   server paused.

`pause_s` is the wall time generation was paused (3 to 6); `reload_s` the apply step alone.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from agentrl.common.control_auth import SHA256_HEADER, SIZE_HEADER, UPLOAD_PATH, control_headers

SHM_DIR = "/dev/shm"
log = logging.getLogger(__name__)


class WeightPushError(RuntimeError):
    """The server refused a push (nothing was applied) or the swap failed."""


@dataclass
class PushResult:
    version: int
    pause_s: float
    reload_s: float
    stage_s: float
    write_s: float
    transport: str = "shm"
    """How the weights reached the server: "shm" (a path on a shared host) or "stream" (over HTTP)."""
    bytes: int = 0
    """The push's size (the safetensors file)."""
    upload_s: float = 0.0
    """With "stream": hashing and sending the bytes, until the server had them all."""


TRANSPORTS = ("auto", "shm", "stream")
"""How a push reaches a server: "shm" hands it the path of a file in this host's /dev/shm (the
server must share the host); "stream" sends the bytes over HTTP to the server's /agentrl/weights,
checksummed, and the server stages its own copy (any host); "auto" is "shm" for a loopback URL,
else "stream". A CUDA collective transport (vLLM's weight-transfer engines, e.g. NCCL) is the next
one behind this choice; it does not exist yet."""


def transport_for(base_url: str, transport: str) -> str:
    """The transport a push to `base_url` uses under the setting `transport` (TRANSPORTS)."""
    from urllib.parse import urlparse

    from agentrl.common.control_auth import is_loopback

    if transport not in TRANSPORTS:
        raise ValueError(f"weight transport {transport!r}: expected one of {', '.join(TRANSPORTS)}")
    if transport != "auto":
        return transport
    return "shm" if is_loopback(urlparse(base_url).hostname) else "stream"


WEIGHTS_DIR_PREFIX = "agentrl-weights-"
_own_dirs: set[Path] = set()
"""The weights directories this process created (and removes when it exits normally)."""


def weights_root() -> Path:
    """Where the per-process weights directories live: /dev/shm, or the temp dir without it."""
    return Path(SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to clean
        return True
    return True


def sweep_weights_dirs(root: Path | None = None) -> list[Path]:
    """Remove this user's weights directories (`agentrl-weights-<pid>`) under `root` whose process no
    longer runs; returns the removed ones. A directory whose PID was reused by a live process is
    kept; another user's is left alone (it is theirs, and 0700)."""
    root = root or weights_root()
    removed = []
    for path in sorted(root.glob(WEIGHTS_DIR_PREFIX + "*")):
        pid = path.name[len(WEIGHTS_DIR_PREFIX):]
        try:
            if not (path.is_dir() and pid.isdigit() and path.stat().st_uid == os.getuid()) or _pid_alive(int(pid)):
                continue
            shutil.rmtree(path)
        except FileNotFoundError:  # another sweeper (a restarted learner, the supervisor) removed it first
            continue
        removed.append(path)
    return removed


def _remove_own_dir(path: Path, owner: int) -> None:
    if os.getpid() == owner and path.is_dir():  # not in a forked child that inherited the handler
        shutil.rmtree(path)


def own_weights_dir() -> Path:
    path = weights_root() / f"{WEIGHTS_DIR_PREFIX}{os.getpid()}"
    if path not in _own_dirs:
        sweep_weights_dirs(path.parent)
        if path.is_dir():  # left by a dead process that had this PID
            shutil.rmtree(path)
        path.mkdir(mode=0o700)
        _own_dirs.add(path)
        atexit.register(_remove_own_dir, path, os.getpid())
    return path


def write_weights(state_dict: Mapping, directory: str | None = None, metadata: dict[str, str] | None = None) -> Path:
    """Write a state dict (name -> tensor, checkpoint names) as safetensors; returns the path. The
    file goes to `directory`, or by default to this process's own weights directory; `metadata`
    goes into its header (an adapter push's: agentrl.common.adapters)."""
    from safetensors.torch import save_file

    directory = directory or str(own_weights_dir())
    fd, path = tempfile.mkstemp(prefix="v-", suffix=".safetensors", dir=directory)
    os.close(fd)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    save_file(tensors, path, metadata=metadata)
    return Path(path)


async def _post(session: aiohttp.ClientSession, url: str, *, json_body=None, params=None) -> dict:
    # The control endpoints need the server's token when it has one (common/control_auth.py).
    async with session.post(url, json=json_body, params=params, headers=control_headers()) as resp:
        text = await resp.text()
        if resp.status >= 400:
            raise WeightPushError(f"POST {url} -> HTTP {resp.status}: {text[:500]}")
        return json.loads(text) if text else {}


async def upload_weights(session: aiohttp.ClientSession, base_url: str, path: Path, chunk_bytes: int = 4 << 20) -> str:
    """Send the file at `path` to the server's /agentrl/weights (the `stream` transport); returns the
    server-side path of its copy. The SHA-256 is computed first and checked by the server."""
    import hashlib


    def digest() -> str:
        hasher = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(chunk_bytes):
                hasher.update(chunk)
        return hasher.hexdigest()

    async def body():
        with open(path, "rb") as f:
            while chunk := await asyncio.to_thread(f.read, chunk_bytes):
                yield chunk

    size = path.stat().st_size
    headers = {**control_headers(), SIZE_HEADER: str(size), SHA256_HEADER: await asyncio.to_thread(digest)}
    url = base_url + UPLOAD_PATH
    # Expect: 100-continue: a push the server refuses on its headers (too large) is answered before the body goes.
    async with session.put(url, data=body(), headers=headers, expect100=True) as resp:
        text = await resp.text()
        if resp.status >= 400:
            raise WeightPushError(f"PUT {url} -> HTTP {resp.status}: {text[:500]}")
    answer = json.loads(text)
    if answer.get("bytes") != size:
        raise WeightPushError(f"PUT {url}: the server kept {answer.get('bytes')} bytes of {size}")
    return answer["path"]


async def _delete_upload(session: aiohttp.ClientSession, base_url: str, server_path: str) -> None:
    """Remove the server's copy of a streamed push. A failure is logged, not raised: the push's own
    outcome (staged, or the stage's error) is what the caller must see; the copy goes with the
    server's weights directory at the latest."""
    url = base_url + UPLOAD_PATH
    try:
        async with session.delete(url, params={"path": server_path}, headers=control_headers()) as resp:
            if resp.status >= 400:
                log.warning("DELETE %s?path=%s -> HTTP %d: %s", url, server_path, resp.status, (await resp.text())[:300])
    except (aiohttp.ClientError, TimeoutError) as err:
        log.warning("DELETE %s?path=%s failed: %s: %s", url, server_path, type(err).__name__, err)


async def _rpc(session: aiohttp.ClientSession, base_url: str, method: str, *args: str) -> dict:
    data = await _post(session, base_url + "/collective_rpc", json_body={"method": method, "args": list(args)})
    results = data.get("results")
    if not results:
        raise WeightPushError(f"{method}: server returned no result ({data}); was it started with agentrl's worker extension?")
    for result in results:  # one per worker; all must agree
        if not isinstance(result, dict) or not result.get("ok"):
            raise WeightPushError(f"{method} refused: {result.get('error') if isinstance(result, dict) else result}")
    return results[0]


async def _load_adapter(session: aiohttp.ClientSession, base_url: str, name: str, folder: str) -> dict:
    """Reload the adapter `name` in place from the server-side peft `folder` (vLLM's
    /v1/load_lora_adapter with load_inplace); its requests in flight continue with it."""
    t0 = time.perf_counter()
    url = base_url + "/v1/load_lora_adapter"
    body = {"lora_name": name, "lora_path": folder, "load_inplace": True}
    async with session.post(url, json=body, headers=control_headers()) as resp:
        text = await resp.text()
        if resp.status == 404:
            raise WeightPushError(f"POST {url} -> HTTP 404: the server has no runtime LoRA loading (start it with "
                                  "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, as agentrl serve-model --lora-adapter does)")
        if resp.status >= 400:
            raise WeightPushError(f"POST {url} -> HTTP {resp.status}: {text[:500]}")
    return {"ok": True, "reload_s": time.perf_counter() - t0}


async def push_weights(
    base_url: str,
    weights: str | Path | Mapping,
    version: int,
    *,
    timeout_s: float = 300.0,
    recompute_kv: bool = True,
    transport: str = "auto",
    metadata: dict[str, str] | None = None,
) -> PushResult:
    """Hot-swap `weights` (a safetensors path, or a state dict with checkpoint names) into the
    server at `base_url` and label them `version`; `recompute_kv`: module docstring, step 3;
    `transport`: how the file reaches the server (TRANSPORTS); `metadata`: the header of the file
    written for a state dict (an adapter's: agentrl.common.adapters.adapter_metadata)."""
    how = transport_for(base_url, transport)
    base_url = base_url.rstrip("/")
    write_s = 0.0
    owned_file = None
    if isinstance(weights, Mapping):
        t0 = time.perf_counter()
        owned_file = write_weights(weights, metadata=metadata)
        write_s = time.perf_counter() - t0
        path = owned_file
    else:
        path = Path(weights).resolve()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        num_bytes = path.stat().st_size
    except FileNotFoundError:
        raise WeightPushError(f"weights file not found: {path}") from None
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            upload_s, server_path = 0.0, str(path)
            if how == "stream":
                t0 = time.perf_counter()
                server_path = await upload_weights(session, base_url, path)
                upload_s = time.perf_counter() - t0
            try:
                staged = await _rpc(session, base_url, "agentrl_stage_weights", server_path)
            except WeightPushError as err:
                if how == "shm" and "not found" in str(err):
                    raise WeightPushError(
                        f"{err} (the 'shm' transport hands the server a path on this host, and the server at "
                        f"{base_url} cannot read it: it runs on another host or in another mount namespace; push "
                        "with transport 'stream': learner.publish.transport = \"stream\", or --transport stream)") from None
                raise
            finally:
                if how == "stream":  # staged (read into the worker) or refused: the server's copy can go
                    await _delete_upload(session, base_url, server_path)
            t_pause = time.perf_counter()
            await _post(session, base_url + "/pause", params={"mode": "keep", "clear_cache": "true" if recompute_kv else "false"})
            try:
                if "lora_dir" in staged:  # a server that serves the adapter itself (vLLM's LoRA path)
                    applied = await _load_adapter(session, base_url, staged["lora_name"], staged["lora_dir"])
                else:
                    applied = await _rpc(session, base_url, "agentrl_apply_staged")
                await _post(session, base_url + "/update_weight_version", json_body={"new_version": str(int(version))})
            finally:
                await _post(session, base_url + "/resume")
            pause_s = time.perf_counter() - t_pause
    except aiohttp.ClientError as err:
        raise WeightPushError(f"push to {base_url} failed: {type(err).__name__}: {err}") from err
    finally:
        if owned_file is not None:
            owned_file.unlink(missing_ok=True)
    return PushResult(int(version), pause_s, float(applied["reload_s"]), float(staged["stage_s"]), write_s,
                      transport=how, bytes=num_bytes, upload_s=upload_s)


async def reset_kv_cache(base_url: str, *, timeout_s: float = 60.0) -> None:
    """Drop the server's KV and prefix caches (running requests are preempted and recompute), so
    that nothing it generates from now on reuses keys and values computed under earlier weights.
    Uses the dev endpoint `/reset_prefix_cache?reset_running_requests=true`, which does not touch
    the pause state a concurrent push relies on."""
    base_url = base_url.rstrip("/")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            answer = await _post(session, base_url + "/reset_prefix_cache", params={"reset_running_requests": "true"})
    except (aiohttp.ClientError, TimeoutError) as err:
        raise WeightPushError(f"cache reset on {base_url} failed: {type(err).__name__}: {err}") from err
    if not answer.get("success"):
        raise WeightPushError(f"cache reset on {base_url} refused: {answer}")


def push_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl push-weights", description="Hot-swap weights into a running server.")
    parser.add_argument("--server", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--weights", required=True, help="safetensors file with checkpoint parameter names")
    parser.add_argument("--version", type=int, default=None, help="policy version label (default: server's + 1)")
    parser.add_argument("--transport", choices=TRANSPORTS, default="auto",
                        help="shm: the server reads the file on this host; stream: the bytes go over HTTP (any host); "
                             "auto: shm for a loopback server, else stream")
    args = parser.parse_args(argv)

    async def run() -> PushResult:
        version = args.version
        if version is None:
            from agentrl.common.inference import VLLMClient

            async with VLLMClient(args.server) as client:
                version = await client.weight_version() + 1
        return await push_weights(args.server, args.weights, version, transport=args.transport)

    try:
        result = asyncio.run(run())
    except WeightPushError as err:
        print(f"agentrl push-weights: {err}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(result)))
    return 0
