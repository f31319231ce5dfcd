"""What agentrl adds to a vLLM server's API process: the control middleware, and the receiving end
of the `stream` weight transport.

`control_middleware` (vLLM's `--middleware`, engine/serve.py) refuses the weight-control paths to
whoever agentrl.common.control_auth's rule refuses (403), and serves `/agentrl/weights` itself.

`PUT /agentrl/weights` takes a push's safetensors bytes over HTTP, from a learner on any host, and
writes them to the server's own weights directory (`/dev/shm/agentrl-weights-<pid>`,
agentrl.common.weights); the learner then stages that server-side path exactly as with the `shm`
transport, where it names a file on its own (shared) host. The request carries `X-Agentrl-Size`
(bytes) and `X-Agentrl-Sha256` (hex digest of the bytes); a body of another length or digest,
or a client that goes away mid-body, leaves no file and answers 400. A size over
`AGENTRL_MAX_WEIGHTS_BYTES` (default 64 GiB) or over the free space of the directory answers 413
before a byte is written. `DELETE /agentrl/weights?path=P` (sent once the server has staged the
push, or refused it) removes that upload; any other push's, finished or in progress, stays. What a
pusher that died before its DELETE left goes with the server's weights directory when the server
exits.

The path is a control endpoint: the middleware lets it through only with the server's control
token (or from loopback without one).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from agentrl.common.control_auth import (
    CONTROL_TOKEN_ENV,
    CONTROL_TOKEN_HEADER,
    SHA256_HEADER,
    SIZE_HEADER,
    UPLOAD_PATH,
    allowed,
)
from agentrl.common.weights import own_weights_dir

MAX_BYTES_ENV = "AGENTRL_MAX_WEIGHTS_BYTES"
DEFAULT_MAX_BYTES = 64 << 30
UPLOAD_PREFIX = "upload-"


async def control_middleware(request, call_next):
    """vLLM `--middleware` function (FastAPI `http` middleware): refuse control paths with 403."""
    ok, why = allowed(request.url.path, request.client.host if request.client else None,
                      request.headers.get(CONTROL_TOKEN_HEADER), os.environ.get(CONTROL_TOKEN_ENV))
    if not ok:
        return _json(403, {"error": why})
    if request.url.path == UPLOAD_PATH:  # the one control endpoint vLLM lacks: a push's bytes (the `stream` transport)
        return await handle(request)
    return await call_next(request)


def _json(status: int, body: dict):
    from starlette.responses import Response

    return Response(json.dumps(body), status_code=status, media_type="application/json")


async def handle(request):
    """PUT: receive one push (module docstring); DELETE: remove the kept upload."""
    directory = own_weights_dir()
    if request.method == "DELETE":
        name = request.query_params.get("path", "")
        path = directory / Path(name).name
        if not name or Path(name).parent != directory or not path.name.startswith(UPLOAD_PREFIX):
            return _json(400, {"ok": False, "error": f"DELETE {UPLOAD_PATH}?path=P: P must be an upload of this server "
                                                     f"({directory}/{UPLOAD_PREFIX}*)"})
        existed = path.exists()
        path.unlink(missing_ok=True)
        return _json(200, {"ok": True, "removed": int(existed)})
    if request.method != "PUT":
        return _json(405, {"ok": False, "error": f"{request.method} {UPLOAD_PATH}: use PUT (a push) or DELETE"})
    size_text, digest = request.headers.get(SIZE_HEADER, ""), request.headers.get(SHA256_HEADER, "").lower()
    if not size_text.isdigit() or int(size_text) == 0 or not re.fullmatch(r"[0-9a-f]{64}", digest):
        return _json(400, {"ok": False, "error": f"a push needs {SIZE_HEADER} (bytes, > 0) and {SHA256_HEADER} (hex)"})
    size = int(size_text)
    limit = int(os.environ.get(MAX_BYTES_ENV, DEFAULT_MAX_BYTES))
    free = shutil.disk_usage(directory).free
    if size > limit or size > free:
        why = f"over {MAX_BYTES_ENV} = {limit}" if size > limit else f"more than the {free} bytes free in {directory}"
        return _json(413, {"ok": False, "error": f"a push of {size} bytes is {why}"})
    t0 = time.perf_counter()
    fd, name = tempfile.mkstemp(prefix=UPLOAD_PREFIX, suffix=".safetensors", dir=directory)
    path = Path(name)
    hasher, received, kept = hashlib.sha256(), 0, False
    try:
        with os.fdopen(fd, "wb") as f:
            async for chunk in request.stream():
                received += len(chunk)
                if received > size:
                    break
                await asyncio.to_thread(_write, f, hasher, chunk)
        if received != size:
            return _json(400, {"ok": False, "error": f"the body is {'longer' if received > size else 'shorter'} than "
                                                     f"{SIZE_HEADER} = {size} bytes; nothing was kept"})
        if hasher.hexdigest() != digest:
            return _json(400, {"ok": False, "error": f"the body's SHA-256 is not {SHA256_HEADER}; nothing was kept"})
        kept = True
        return _json(200, {"ok": True, "path": str(path), "bytes": received, "receive_s": time.perf_counter() - t0})
    finally:
        if not kept:  # a refused body, or a client that went away (the stream raised)
            path.unlink(missing_ok=True)


def _write(f, hasher, chunk: bytes) -> None:
    hasher.update(chunk)
    f.write(chunk)
