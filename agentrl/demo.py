"""`agentrl demo`: the foundation end to end, in about a minute and a half.

Starts a real vLLM server on the prepared SmolLM2-135M-Instruct, sends token-in/token-out
requests, hot-swaps weights while 32 requests are in flight, and shows that the in-flight
requests finished with tokens from both policy versions. Stops the server by PID at the end.
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

QUESTIONS = [
    "What is the capital of France?",
    "Name a large animal that lives in the ocean.",
    "What is 12 plus 30?",
]


async def _run(server, tokenizer) -> dict:
    from safetensors.torch import load_file

    from agentrl.common.inference import SamplingParams, VLLMClient
    from agentrl.common.weights import push_weights, write_weights

    def chat(q: str) -> list[int]:
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        ))

    async with VLLMClient(server.base_url) as client:
        print("\n-- token-in/token-out (greedy)")
        for q in QUESTIONS:
            ids = chat(q)
            gen = await client.generate(ids, SamplingParams(max_tokens=40, temperature=0.0))
            mean_lp = sum(gen.logprobs) / len(gen.logprobs)
            print(f"Q: {q}\n   {len(ids)} prompt ids -> {len(gen.token_ids)} sampled ids, "
                  f"mean log-prob {mean_lp:.3f}, version {gen.versions[0]}")
            print(f"A: {tokenizer.decode(gen.token_ids, skip_special_tokens=True)!r}")

        print("\n-- hot swap with 32 requests in flight")
        version = await client.weight_version()
        path = write_weights(load_file(f"{server.model_dir}/model.safetensors"))
        ids = chat("Tell me a short story about a lighthouse keeper.")
        inflight = [
            asyncio.create_task(client.generate(ids, SamplingParams(max_tokens=96, temperature=1.0, seed=i, ignore_eos=True)))
            for i in range(32)
        ]
        await asyncio.sleep(1.0)
        try:
            result = await push_weights(server.base_url, path, version + 1)
        finally:
            path.unlink(missing_ok=True)
        gens = await asyncio.gather(*inflight)
        spanning = sum(1 for g in gens if len(set(g.versions)) > 1)
        print(f"pushed version {result.version}: paused {result.pause_s:.2f} s (reload {result.reload_s:.2f} s); "
              f"{len(gens)}/32 in-flight requests completed, {spanning} of them carry tokens of both versions")
        return {
            "demo": "ok",
            "server": server.base_url,
            "pause_s": round(result.pause_s, 3),
            "reload_s": round(result.reload_s, 3),
            "inflight_completed": len(gens),
            "inflight_spanning_swap": spanning,
            "served_version": await client.weight_version(),
        }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF model folder (default: the prepared SmolLM2)")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from agentrl.engine.serve import VLLMServer, VLLMServerConfig

    server = VLLMServer(VLLMServerConfig(model_dir=args.model))
    print(f"starting vLLM on {server.base_url} (log: {server.log_path}) ...", flush=True)
    t0 = time.perf_counter()
    server.start()
    print(f"server ready in {time.perf_counter() - t0:.0f} s (pid {server.pid})", flush=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(server.model_dir)
        summary = asyncio.run(_run(server, tokenizer))
    finally:
        server.stop()
    print(json.dumps(summary))
    return 0
