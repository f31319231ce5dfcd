"""Phase 2 of `agentrl train`: the untrained policy with tools (Base Tool Call) and the
environment's baselines on the held-out tasks, or their results from an earlier run with the same
key (agentrl/evalcache.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from pathlib import Path

from agentrl import evalcache
from agentrl.budget import evenly_spaced
from agentrl.common.config import to_dict
from agentrl.engine.environments import env_class
from agentrl.engine.evaluation import GREEDY, evaluate_baselines
from agentrl.phases.evaluations import write_sample


def baseline_tasks(sup) -> list:
    return evenly_spaced(sup.heldout, sup.config.eval.baseline_questions)


def baseline_cache(sup) -> tuple[Path, str, dict] | None:
    """(cache folder, key, key inputs) of the untrained policy's evaluations, or None where the cache
    does not apply: turned off, servers given with --vllm, an [agent]."""
    from agentrl.engine.serve import cfg_dtype

    cfg = sup.config
    # Servers and tools from outside the run (--vllm, --tool-endpoint, [[tools]]) may change
    # without anything in the key changing.
    if (not cfg.eval.cache_baselines or cfg.services.vllm or cfg.services.tool_endpoints or cfg.tools
            or cfg.agent.enabled):
        return None
    env_source = inspect.getsourcefile(env_class(cfg.env))  # a plug-in environment's own file
    if env_source is None:  # no source to hash (a compiled module): nothing to key its behaviour on
        return None
    cache_dir = evalcache.default_cache_dir(cfg.eval.cache_dir)
    inputs = evalcache.key_inputs(
        model_dir=sup.model_dir, dtype=cfg_dtype(cfg.services.vllm_server.dtype),
        max_model_len=cfg.services.vllm_server.max_model_len,
        env=to_dict(cfg.env), prompt=sup.prompt(), tasks=[dataclasses.asdict(t) for t in baseline_tasks(sup)],
        decoding=dataclasses.asdict(GREEDY), baselines=["environment"] if cfg.eval.baselines else [],
        files={"env_source": Path(env_source), **({"corpus": sup.taskset.corpus} if sup.taskset.corpus else {})},
        memo_dir=cache_dir)
    return cache_dir, evalcache.cache_key(inputs), inputs


async def baseline_phase(sup) -> None:
    cache = await asyncio.to_thread(baseline_cache, sup)  # hashes files: the event loop keeps answering heartbeats
    if cache is not None and (entry := evalcache.lookup(cache[0], cache[1])) is not None:
        evalcache.restore(entry, sup.out)
        cached = entry["summaries"]
        result = {"base_tool_call": cached["base_tool_call"], "baselines": cached["baselines"], "cached": entry["path"]}
        sup.say(f"baseline evaluations read from the cache: {entry['path']} (same model files, dtype, code, "
                "prompt, held-out tasks and decoding; eval.cache_baselines = false evaluates again)")
        for summary in [result["base_tool_call"], *result["baselines"].values()]:
            sup.log_eval({**summary, "time": time.time(), "cached": True})
        sup.phase_done("baseline", result)
        return
    tasks = baseline_tasks(sup)
    if len(tasks) < len(sup.heldout):
        sup.say(f"Base Tool Call and the baselines on {len(tasks)} of the {len(sup.heldout)} held-out tasks "
                "(eval.baseline_questions; the SFT and final evaluations use all of them)")
    summary, trajs = await sup.evaluations.run(tasks, "base_tool_call")
    if len(tasks) < len(sup.heldout):
        summary["subset_of"] = len(sup.heldout)
    sup.log_eval(summary, trajs)
    write_sample(sup.out / "trajectories_base.jsonl", trajs[:8], sup.conn.chat)
    result = {"base_tool_call": summary, "baselines": {}}
    if sup.config.eval.baselines:
        for name, (baseline, _) in (await evaluate_baselines(sup.conn, tasks)).items():
            sup.log_eval(baseline)
            result["baselines"][name] = baseline
    failed = summary["num_failed"] + sum(b["num_failed"] for b in result["baselines"].values())
    if cache is not None and failed:
        sup.say(f"baseline evaluations not cached: {failed} episodes failed (a tool or server fault is not a result to keep)")
    elif cache is not None:
        name = f"base_tool_call-v{summary['served_version']}"
        files = [f for f in (f"evals/{name}.jsonl", f"evals/{name}.text.jsonl.gz", "trajectories_base.jsonl")
                 if (sup.out / f).is_file()]
        path = evalcache.store(cache[0], cache[1], cache[2], {"base_tool_call": summary, "baselines": result["baselines"]},
                               sup.out, files)
        sup.say(f"baseline evaluations cached in {path}")
    sup.phase_done("baseline", result)
