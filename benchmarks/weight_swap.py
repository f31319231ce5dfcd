"""Hot-swap latency with requests in flight, on the real vLLM server and the prepared SmolLM2-135M,
for both weight transports side by side.

Starts its own server (bf16, as training serves), keeps `num_inflight` sampling requests running,
and pushes full weights `num_swaps` times per transport (after one warm-up push), alternating the
transports push by push (shm, stream, shm, ...) and two weight sets so every swap really changes the
model. Reports the median and spread, per transport (the `stream_` keys for stream), of:
- pause_s: wall time generation was paused (pause keep + reload + version + resume);
- push_s: the whole push as the learner waits for it (write, upload for stream, stage, pause, apply);
- reload_s: the layer-wise reload alone;
- stage_s: reading + validating the pushed file in the worker (generation continues meanwhile);
- write_s: writing the state dict to /dev/shm (on the trainer's side, generation continues);
- upload_s (stream): hashing and sending the bytes to the server's /agentrl/weights;
and `stream_bytes_per_push`. The server runs on this host, so both transports work; stream is what
a server on another host gets (agentrl/common/weights.py). Also checks that every in-flight request
completed. Prints one JSON line last.

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

TRANSPORTS = ("shm", "stream")


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
        for i in range(2 * (num_swaps + 1)):  # the first push of each transport is a warm-up
            transport = TRANSPORTS[i % 2]
            weights = perturbed if i % 2 == 0 else original  # every push changes the served model
            t0 = time.perf_counter()
            r = await push_weights(server.base_url, weights, i + 1, transport=transport)
            if i >= 2:
                results.append((r, time.perf_counter() - t0))
            await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*workers)
        await push_weights(server.base_url, original, 0)

    def stats(key: str, transport: str) -> dict:
        xs = [push_s if key == "push_s" else getattr(r, key) for r, push_s in results if r.transport == transport]
        prefix = "" if transport == "shm" else "stream_"
        return {f"{prefix}{key}_median": round(statistics.median(xs), 4), f"{prefix}{key}_min": round(min(xs), 4),
                f"{prefix}{key}_max": round(max(xs), 4)}

    out = {"num_swaps": len(results) // 2, "num_inflight": num_inflight, "requests_completed": completed}
    for transport in TRANSPORTS:
        for key in ("pause_s", "push_s", "reload_s", "stage_s", "write_s", *(("upload_s",) if transport == "stream" else ())):
            out.update(stats(key, transport))
    out["stream_bytes_per_push"] = statistics.median(r.bytes for r, _ in results if r.transport == "stream")
    out["stream_pause_vs_shm"] = round(out["stream_pause_s_median"] / out["pause_s_median"], 3)
    out["stream_push_vs_shm"] = round(out["stream_push_s_median"] / out["push_s_median"], 3)
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
