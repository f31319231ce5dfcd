"""Hot-swap latency with requests in flight, on the real vLLM server and the prepared SmolLM2-135M.

Starts its own server (bf16, as training serves), keeps `num_inflight` sampling requests running,
and pushes full weights `num_swaps` times (after one warm-up push), alternating two weight sets so
every swap really changes the model. Reports the median and spread of:
- pause_s: wall time generation was paused (pause keep + reload + version + resume);
- reload_s: the layer-wise reload alone;
- stage_s: reading + validating the pushed file in the worker (generation continues meanwhile);
- write_s: writing the state dict to /dev/shm (on the trainer's side, generation continues).
Also checks that every in-flight request completed. Prints one JSON line last.

Run: python benchmarks/weight_swap.py [--swaps 5] [--inflight 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import time

import torch


def machine_info() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"cpu_count": os.cpu_count(), "machine": platform.machine(), "torch": torch.__version__, "commit": commit}


async def bench(server, num_swaps: int, num_inflight: int) -> dict:
    from safetensors.torch import load_file

    from agentrl.common.inference import SamplingParams, VLLMClient
    from agentrl.common.weights import push_weights

    original = load_file(f"{server.model_dir}/model.safetensors")
    gen = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.01 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in original.items()}
    prompt = list(range(1000, 1064))
    results = []
    completed = 0
    async with VLLMClient(server.base_url) as client:
        stop = asyncio.Event()

        async def load_loop(seed: int) -> None:
            nonlocal completed
            i = 0
            while not stop.is_set():
                await client.generate(prompt, SamplingParams(max_tokens=64, temperature=1.0, seed=seed * 1000 + i, ignore_eos=True))
                completed += 1
                i += 1

        workers = [asyncio.create_task(load_loop(s)) for s in range(num_inflight)]
        await asyncio.sleep(3.0)
        for i in range(num_swaps + 1):  # the first push is a warm-up (first read of the record)
            weights = perturbed if i % 2 == 0 else original
            r = await push_weights(server.base_url, weights, i + 1)
            if i > 0:
                results.append(r)
            await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*workers)
        await push_weights(server.base_url, original, 0)

    def stats(key: str) -> dict:
        xs = [getattr(r, key) for r in results]
        return {f"{key}_median": round(statistics.median(xs), 4), f"{key}_min": round(min(xs), 4), f"{key}_max": round(max(xs), 4)}

    out = {"num_swaps": len(results), "num_inflight": num_inflight, "requests_completed": completed}
    for key in ("pause_s", "reload_s", "stage_s", "write_s"):
        out.update(stats(key))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--swaps", type=int, default=5)
    parser.add_argument("--inflight", type=int, default=32)
    args = parser.parse_args()

    from agentrl.engine.serve import VLLMServer, VLLMServerConfig

    server = VLLMServer(VLLMServerConfig(dtype="bfloat16"))
    t0 = time.perf_counter()
    server.start()
    start_s = time.perf_counter() - t0
    try:
        result = asyncio.run(bench(server, args.swaps, args.inflight))
    finally:
        server.stop()
    result.update({"server_start_s": round(start_s, 1), "model": "SmolLM2-135M-Instruct", "dtype": "bfloat16"})
    result.update(machine_info())
    print(json.dumps(result))


if __name__ == "__main__":
    from agentrl.common.procs import exit_on_sigterm

    exit_on_sigterm()
    main()
