"""How long fresh CPU vLLM servers take to answer their first and second requests, on a fresh
(private) Inductor cache, with torch.compile on or off. Prints one JSON line.

    python -P docs/notes/experiments/server_first_request.py compile|nocompile [NUM_SERVERS]

Session 8 (AMD EPYC, AVX2, float32, quiet machine), seconds per request (300-token prompt, 16 tokens):
compile 1 server: first 13.7, second 1.5; compile 2 servers: first 15.5 / 18.5, second 1.4 / 3.8;
nocompile 2 servers: first 6.2 / 3.1, second 3.9 / 1.4.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time

from agentrl.common.inference import SamplingParams, VLLMClient
from agentrl.common.model import prepare_model
from agentrl.engine.serve import VLLMServer, VLLMServerConfig


async def generate(url: str) -> tuple[float, int]:
    async with VLLMClient(url) as client:
        t = time.monotonic()
        gen = await client.generate(list(range(100, 400)), SamplingParams(max_tokens=16, temperature=1.0, seed=1))
        return round(time.monotonic() - t, 1), len(gen.token_ids)


async def two_requests(servers: list[VLLMServer]) -> tuple[list, list]:
    first = await asyncio.gather(*(generate(s.base_url) for s in servers))
    second = await asyncio.gather(*(generate(s.base_url) for s in servers))
    return first, second


def main(mode: str, num_servers: int) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    os.environ["TORCH_COMPILE_DISABLE"] = "1" if mode == "nocompile" else "0"
    logs = tempfile.mkdtemp(prefix="first-request-")
    servers = [VLLMServer(VLLMServerConfig(model_dir=str(prepare_model())), log_path=f"{logs}/{mode}-{i}.log")
               for i in range(num_servers)]
    out: dict = {"mode": mode, "servers": num_servers}
    t0 = time.monotonic()
    try:
        for server in servers:
            server.start(timeout_s=600)
        out["start_s"] = round(time.monotonic() - t0, 1)
        out["first"], out["second"] = asyncio.run(two_requests(servers))
    finally:
        for server in servers:
            server.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
