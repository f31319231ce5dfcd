"""The end of `agentrl train`: the policy exported, the report written (agentrl/report.py), and the
run's summary, the JSON line the run prints last: scores before / after SFT / after RL, whether RL
ran, steps, episodes, restarts, where the minutes went, the environment's own metrics, baselines,
per-group scores and the RL-vs-SFT sign test."""

from __future__ import annotations

import time
from pathlib import Path

from agentrl.common.files import read_jsonl
from agentrl.engine.environments import env_class


def finish_run(out: Path, phases: dict, supervisor, *, started: float) -> dict:
    """Export the policy, write the report, and the run's summary (the JSON line)."""
    from agentrl.export import export
    from agentrl.learner.checkpoint import checkpoint_dirs
    from agentrl.report import (
        eval_records,
        evaluation_seconds,
        no_rl_reason,
        paired_by,
        paired_comparison,
        write_report,
    )

    if checkpoint_dirs(out / "rl" / "checkpoints") or checkpoint_dirs(out / "sft" / "checkpoints"):
        hf = str(export(out, out / "hf"))
    else:  # neither SFT nor RL made a step: the initial model folder is the policy
        hf = None
        supervisor.say(f"nothing exported: no step was trained; the policy is the initial model {supervisor.model_dir}")
    report = write_report(out)
    base = phases["baseline"]["base_tool_call"]
    final = phases["final"]
    rl_metrics = last_metrics(out / "rl" / "metrics.jsonl")
    sft = phases.get("sft", {})
    rl = phases.get("rl", {})
    summary = {
        "score_metric": final["score_metric"],
        "score_before": round(base["score"], 4),
        "score_sft": round(sft["score"], 4) if "score" in sft else None,
        "score_after": round(final["score"], 4),
        "rl_ran": rl.get("rl_steps", 0) > 0,
        "rl_steps": rl.get("rl_steps", 0),
        "rl_stopped_reason": rl.get("stopped_reason") or ("skipped" if rl.get("skipped") else None),
        "groups_dropped_equal_share": dropped_equal_share(out / "rl" / "checkpoints"),
        "sft_steps_done": sft.get("steps_done", 0),
        "episodes": actor_episodes(out / "actor" / "stats.jsonl"),
        "optimizer_steps": rl_metrics.get("step", sft.get("steps_done", 0)),
        "learner_restarts": rl.get("learner_restarts", 0),
        "server_restarts": rl.get("server_restarts", 0),
        "tool_restarts": rl.get("tool_restarts", 0),
        "minutes": round((time.time() - started) / 60, 2),
        "minutes_after_setup": round((time.time() - started - supervisor.setup_s - supervisor.diagnostic_s) / 60, 2),
        "setup_minutes": round(supervisor.setup_s / 60, 2),
        "eval_minutes": round(evaluation_seconds(supervisor.evaluations.summaries) / 60, 2),
        "sft_minutes": round(sft.get("sft_s", 0.0) / 60, 2),
        "rl_minutes": round(rl.get("rl_s", 0.0) / 60, 2),
        "diagnostic_minutes": round(supervisor.diagnostic_s / 60, 2),
        "baselines_cached": "cached" in phases["baseline"],
        "report": str(report),
        "hf": hf,
        "out": str(out),
    }
    if not summary["rl_ran"]:
        summary["rl_note"] = no_rl_reason(phases)
    for metric in env_class(supervisor.config.env).summary_metrics:  # the environment's own keys (QA: em, f1)
        for label, s in (("before", base), ("sft", sft), ("after", final)):
            if metric in s:
                summary[f"{metric}_{label}"] = round(s[metric], 4)
    for name, s in phases["baseline"].get("baselines", {}).items():
        summary[f"{final['score_metric']}_{name}"] = round(s["score"], 4)
    for key in sorted(k for k in final if k.startswith("by_")):
        name = key.replace("by_num_", "by_")  # a count in the metadata (num_hops) reads as by_hops
        for label, s in (("before", base), ("sft", sft), ("after", final)):
            if key in s:
                summary[f"{final['score_metric']}_{label}_{name}"] = {v: round(c["score"], 4) for v, c in s[key].items()}
                summary[f"calls_{label}_{name}"] = {v: round(c["calls_per_episode"], 3) for v, c in s[key].items()}
    if "final_without_tools" in phases:
        summary[f"{final['score_metric']}_after_without_tools"] = round(phases["final_without_tools"]["score"], 4)
    if "final_transfer" in phases:  # synthetic QA: 3-hop questions; by_hops only when they mix hop counts
        transfer = phases["final_transfer"]
        summary[f"{final['score_metric']}_after_transfer"] = round(transfer["score"], 4)
        summary["calls_after_transfer"] = round(transfer["calls_per_episode"], 3)
        for key in sorted(k for k in transfer if k.startswith("by_")):
            summary[f"{final['score_metric']}_after_transfer_{key.replace('by_num_', 'by_')}"] = {
                v: round(c["score"], 4) for v, c in transfer[key].items()}
    if "score" in sft and summary["rl_ran"]:
        paired = paired_comparison(eval_records(out, "sft", sft), eval_records(out, "final", final))
        if paired:
            summary |= {"rl_vs_sft_gained": paired["gained"], "rl_vs_sft_lost": paired["lost"],
                        "rl_vs_sft_p_value": round(paired["p_value"], 4)}
        for key, by_value in paired_by(out, ("sft", sft), ("final", final)).items():
            summary[f"rl_vs_sft_by_{key.replace('num_', '')}"] = {
                v: {"gained": p["gained"], "lost": p["lost"], "p_value": round(p["p_value"], 4)} for v, p in by_value.items()}
    return summary


def last_metrics(path: Path) -> dict:
    records = read_jsonl(path)
    return records[-1] if records else {}


def actor_episodes(path: Path) -> int:
    """Episodes finished by the actor (summed over actor restarts)."""
    total, last = 0, None
    for rec in read_jsonl(path):
        if last is not None and rec["num_episodes_finished"] < last:
            total += last
        last = rec["num_episodes_finished"]
    return total + (last or 0)


def dropped_equal_share(checkpoints: Path) -> float | None:
    """Of the groups the RL learner consumed (its latest checkpoint's ledger: trained or rejected), the
    share dropped for equal rewards (dynamic sampling); None without an RL checkpoint."""
    from agentrl.learner.checkpoint import checkpoint_dirs, load_latest_checkpoint

    if not checkpoint_dirs(checkpoints):
        return None
    ledger = load_latest_checkpoint(checkpoints)["ledger"]
    consumed = len(ledger["trained"]) + len(ledger["rejected"])
    equal = sum(reason == "equal_rewards" for reason in ledger["rejected"].values())
    return round(equal / consumed, 4) if consumed else None
