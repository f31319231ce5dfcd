"""`report.md` and its plots for a run directory of `agentrl train`.

Reads only files the run wrote (phases.json, evals.jsonl, sft/ and rl/metrics.jsonl,
actor/stats.jsonl), so it can be regenerated after the fact: `python -m agentrl.report RUN_DIR`.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from agentrl.common.files import read_jsonl  # noqa: E402

DIAGNOSTICS = ("final_without_tools", "final_transfer")
"""Evaluations after the budget (eval.without_tools, eval.transfer) on another environment or task
set: not in the budget's evaluation time, not points of the score curves."""


def evaluation_seconds(evals: list[dict], *, diagnostics: bool = False) -> float:
    """Seconds spent in the evaluations `evals` that ran: not the ones read from the cache or
    reused for an unchanged policy; the diagnostics after the budget only with `diagnostics`."""
    return sum(float(e.get("eval_s", 0.0)) for e in evals
               if not e.get("cached") and not e.get("repeat_of") and (diagnostics or e.get("label") not in DIAGNOSTICS))


def _plot(path: Path, title: str, series: dict[str, tuple[list, list]], xlabel: str, ylabel: str = "") -> str | None:
    fig = _figure(title, series, xlabel, ylabel)
    if fig is None:
        return None
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def plot_svg(title: str, series: dict[str, tuple[list, list]], xlabel: str, ylabel: str = "") -> str | None:
    """The same chart as the report's PNGs, as an inline `<svg>` element (agentrl view's pages)."""
    import io

    fig = _figure(title, series, xlabel, ylabel)
    if fig is None:
        return None
    out = io.StringIO()
    fig.savefig(out, format="svg")
    plt.close(fig)
    text = out.getvalue()
    return text[text.index("<svg"):]  # without the XML declaration and doctype of a standalone file


def _figure(title: str, series: dict[str, tuple[list, list]], xlabel: str, ylabel: str):
    series = {k: v for k, v in series.items() if v[0]}
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def eval_records(run: Path, label: str, summary: dict) -> dict[str, float]:
    """task id -> score of the evaluation `label` whose summary is `summary` (written by the supervisor)."""
    path = run / "evals" / f"{label}-v{summary.get('served_version')}.jsonl"
    return {r["task_id"]: r["score"] for r in read_jsonl(path)}


def paired_comparison(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """Questions answered right by one policy and wrong by the other, and the exact two-sided sign
    test on those discordant pairs (the questions both get right or both get wrong carry no
    information about which is better). None when the two evaluations share no question."""
    common = sorted(set(before) & set(after))
    if not common:
        return None
    gained = sum(after[q] > before[q] for q in common)
    lost = sum(after[q] < before[q] for q in common)
    n = gained + lost
    tail = sum(math.comb(n, k) for k in range(min(gained, lost) + 1)) / 2**n if n else 1.0
    return {"n": len(common), "gained": gained, "lost": lost, "p_value": min(1.0, 2 * tail)}


def paired_by(run: Path, before: tuple[str, dict], after: tuple[str, dict]) -> dict[str, dict[str, dict]]:
    """`paired_comparison` of two evaluations within each group of the tasks' `report_by` metadata
    (recorded per task under "group"): {key: {value: comparison}}, e.g. {"num_hops": {"2": ...}}."""
    rows = {label: read_jsonl(run / "evals" / f"{label}-v{summary.get('served_version')}.jsonl") for label, summary in (before, after)}
    groups: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for label, records in rows.items():
        for r in records:
            for key, value in r.get("group", {}).items():
                groups.setdefault(key, {}).setdefault(value, {}).setdefault(label, {})[r["task_id"]] = r["score"]
    out: dict[str, dict[str, dict]] = {}
    for key, values in groups.items():
        for value, by_label in sorted(values.items()):
            paired = paired_comparison(by_label.get(before[0], {}), by_label.get(after[0], {}))
            if paired is not None and len(values) > 1:
                out.setdefault(key, {})[value] = paired
    return out


def no_rl_reason(phases: dict) -> str:
    """Why a run's final policy was not trained by RL, in one sentence (report and JSON line)."""
    rl = phases.get("rl", {})
    if rl.get("skipped"):
        why = "the SFT cold start and the evaluations left no time for it in the budget"
    elif "rl" in phases:
        why = f"its phase ran {rl.get('rl_s', 0.0) / 60:.1f} minutes and made no optimizer step"
    else:
        why = "the run did not reach it"
    return f"RL did not run: {why}; the final policy is the {'SFT checkpoint' if 'score' in phases.get('sft', {}) else 'initial model'}"


STOPPED = {"budget": "its time was up", "max_steps": "the learner reached learner.max_steps",
           "no_signal": "no learning signal was left (rl.stop_when_no_signal)"}


def signal_text(stats: dict) -> list[str]:
    """What the actor's latest stats say of the learning signal (engine/curriculum.py SignalMonitor), as
    short phrases for the status line and the report: equal-reward groups among the recent ones, and
    groups without any task reward."""
    out = []
    recent = stats.get("signal/recent_groups", 0)
    if recent:
        out.append(f"{stats.get('signal/recent_equal', 0)} of the last {recent} groups without signal (equal rewards)")
    since = stats.get("signal/groups_since_task_reward", 0)
    if since >= 10:
        out.append(f"no episode has earned task reward in the last {since} groups")
    return out


def signal_lines(stats: dict, rl: dict, final: dict | None) -> list[str]:
    """The report's lines on the learning signal of the RL phase."""
    lines = []
    if stats.get("signal/groups"):
        lines.append(f"- groups with the same rewards in every sample (no signal; dropped under dynamic sampling): "
                     f"{stats['signal/equal_groups']} of {stats['signal/groups']}; now: " + "; ".join(signal_text(stats)))
    if rl.get("stopped_reason") in STOPPED:
        lines.append(f"- RL ended because {STOPPED[rl['stopped_reason']]}")
    if final is not None and final.get("score", 0.0) >= 1.0:
        lines.append("- held-out at ceiling: the final policy solves every held-out task; RL has nothing left to gain on them")
    return lines


def time_table(phases: dict, evals: list[dict]) -> list[str]:
    """Markdown: minutes of each phase of the budget (evaluations apart from training)."""
    def minutes(label: str) -> float:
        return evaluation_seconds([e for e in evals if e.get("label") == label], diagnostics=True) / 60

    base = phases.get("baseline", {})
    rows = [("held-out evaluations before training" + (" (read from the cache)" if base.get("cached") else ""),
             sum(minutes(name) for name in ["base_tool_call", *base.get("baselines", {})])),
            ("SFT cold start (training)", phases.get("sft", {}).get("sft_s", 0.0) / 60),
            ("held-out evaluation after SFT", minutes("sft")),
            ("RL phase (training; its evaluations below)", phases.get("rl", {}).get("rl_s", 0.0) / 60),
            ("held-out evaluations during RL", minutes("rl")),
            ("final held-out evaluation" + (" (reused: the policy was unchanged)" if phases.get("final", {}).get("repeat_of") else ""),
             minutes("final")),
            ("diagnostics after the budget (opt-in)", minutes("final_without_tools") + minutes("final_transfer"))]
    return ["", "## Where the time went", "", "| phase | minutes |", "| --- | --- |",
            *(f"| {name} | {value:.1f} |" for name, value in rows)]


def failure_table(rows: list[tuple[str, dict | None]]) -> list[str]:
    """Markdown: for each policy and each value of the first metadata key the scores are broken down
    by (`by_KEY`, the environment's `report_by`; QA: num_hops), the share of episodes with each
    failure label the environment reports (metrics `fail_*`, e.g. the QA environment's
    FAILURE_LABELS); [] when none does."""
    keys = sorted({k for _, r in rows if r for k in r if k.startswith("by_")
                   and any(label.startswith("fail_") for cell in r[k].values() for label in cell)})
    if not keys:
        return []
    key = keys[0]
    labels = sorted({k for _, r in rows if r for cell in r.get(key, {}).values() for k in cell if k.startswith("fail_")})
    name_of_key = key.removeprefix("by_")
    lines = ["", f"### Why held-out answers are wrong, by {name_of_key}", "",
             f"Share of the episodes of each {name_of_key} (one episode can carry several labels):", "",
             f"| policy | {name_of_key} | n | score | " + " | ".join(k.removeprefix("fail_") for k in labels) + " |",
             "| --- " * (len(labels) + 4) + "|"]
    for name, r in rows:
        for value, cell in sorted((r or {}).get(key, {}).items()):
            lines.append(f"| {name} | {value} | {cell['n']} | {cell['score']:.3f} | "
                         + " | ".join(f"{cell.get(k, 0.0):.2f}" for k in labels) + " |")
    return lines


def heldout_curves(phases: dict, evals: list[dict]) -> tuple[str, dict[str, tuple[list, list]]]:
    """The score metric and the held-out curves over minutes since the first evaluation: the score,
    F1 where there is one, and the score per `report_by` value; baselines and diagnostics left out."""
    t0 = min((e["time"] for e in evals), default=0.0)
    baselines = set(phases.get("baseline", {}).get("baselines", {}))
    tracked = [e for e in evals if e["label"] not in baselines and e["label"] not in DIAGNOSTICS]
    metric = phases.get("final", {}).get("score_metric") or (tracked[0].get("score_metric", "score") if tracked else "score")
    curves = {metric: ([(e["time"] - t0) / 60 for e in tracked], [e["score"] for e in tracked])}
    with_f1 = [e for e in tracked if "f1" in e]  # an evaluation whose every episode failed has no f1
    if with_f1:
        curves["f1"] = ([(e["time"] - t0) / 60 for e in with_f1], [e["f1"] for e in with_f1])
    for key in sorted({k for e in tracked for k in e if k.startswith("by_")}):
        for value in sorted({v for e in tracked for v in e.get(key, {})}):
            sel = [e for e in tracked if value in e.get(key, {})]
            curves[f"{metric} {key.removeprefix('by_')}={value}"] = ([(e["time"] - t0) / 60 for e in sel],
                                                                     [e[key][value]["score"] for e in sel])
    return metric, curves


def reward_curves(rl: list[dict]) -> dict[str, tuple[list, list]]:
    """Each raw reward term's mean per episode over the RL steps (the learner's metrics lines)."""
    keys = sorted({k for r in rl for k in r if k.startswith("reward/") and not k.startswith("reward/weight")})
    return {k.removeprefix("reward/"): ([r["step"] for r in rl if k in r], [r[k] for r in rl if k in r]) for k in keys}


def write_report(run_dir: str | Path) -> Path:
    run = Path(run_dir)
    plots = run / "plots"
    plots.mkdir(exist_ok=True)
    phases = json.loads((run / "phases.json").read_text()) if (run / "phases.json").exists() else {}
    evals = read_jsonl(run / "evals.jsonl")
    sft = read_jsonl(run / "sft" / "metrics.jsonl")
    rl = read_jsonl(run / "rl" / "metrics.jsonl")
    actor = read_jsonl(run / "actor" / "stats.jsonl")
    images: list[tuple[str, str | None]] = []

    metric, curves = heldout_curves(phases, evals)
    images.append((f"Held-out {metric} over time", _plot(
        plots / "heldout_score.png", f"Held-out {metric} (greedy)", curves, "minutes since the first evaluation")))
    images.append(("Reward terms (RL, per optimizer step; raw means per episode)", _plot(
        plots / "rewards.png", "Reward terms", reward_curves(rl), "learner version (optimizer step)")))

    images.append(("Staleness of trained tokens (versions behind the learner)", _plot(
        plots / "staleness.png", "Staleness",
        {"mean": ([r["step"] for r in rl if "staleness/mean" in r], [r["staleness/mean"] for r in rl if "staleness/mean" in r]),
         "max": ([r["step"] for r in rl if "staleness/max" in r], [r["staleness/max"] for r in rl if "staleness/max" in r])},
        "learner version")))
    images.append(("Learner throughput", _plot(
        plots / "learner_throughput.png", "Learner tokens/s",
        {"sft": ([r["step"] for r in sft if "tokens_per_s" in r], [r["tokens_per_s"] for r in sft if "tokens_per_s" in r]),
         "rl": ([r["step"] for r in rl if "tokens_per_s" in r], [r["tokens_per_s"] for r in rl if "tokens_per_s" in r])},
        "learner version", "tokens/s")))
    if actor:
        xs = [a["elapsed_s"] / 60 for a in actor]
        images.append(("Actor throughput", _plot(
            plots / "actor_throughput.png", "Episodes finished (cumulative)",
            {"episodes": (xs, [a["num_episodes_finished"] for a in actor]),
             "groups": (xs, [a["num_groups_emitted"] for a in actor])}, "minutes of RL")))
    images.append(("Learner time split per step (s)", _plot(
        plots / "time_split.png", "Where the learner's time goes",
        {name: ([r["step"] for r in rl if key in r], [r[key] for r in rl if key in r])
         for name, key in (("waiting for data", "time/wait_s"), ("computing", "time/compute_s"),
                           ("publishing (stall)", "time/publish_stall_s"))},
        "learner version", "seconds")))

    lines = ["# Training report", ""]
    base = phases.get("baseline", {})
    sft_phase = phases.get("sft") if "score" in phases.get("sft", {}) else None
    rl_steps = phases.get("rl", {}).get("rl_steps")  # absent in runs from before it was recorded: their metrics say
    rl_ran = rl_steps > 0 if rl_steps is not None else any("loss" in r for r in rl)
    if phases.get("final") and not rl_ran:
        lines += [f"**{no_rl_reason(phases)}.** The row \"Final\" below is that policy, not an RL result; a longer "
                  "budget (`--minutes`) gives RL its time (the run's log says how much this machine needs).", ""]
    lines += [f"Run directory: `{run}`", ""]
    final_label = "After RL (final)" if rl_ran else "Final (no RL step: " + ("the SFT checkpoint)" if sft_phase else "the initial model)")
    subset = (base.get("base_tool_call") or {}).get("subset_of")
    rows = [("Base Tool Call (untrained, with tools" + (f"; {base['base_tool_call']['n']} of the {subset} held-out tasks)"
                                                        if subset else ")"), base.get("base_tool_call")),
            *((name, summary) for name, summary in base.get("baselines", {}).items()),
            ("After SFT cold start", sft_phase), (final_label, phases.get("final"))]
    extra = [k for k in ("f1",) if any(r and k in r for _, r in rows)]
    by_keys = sorted({k for _, r in rows if r for k in r if k.startswith("by_")})
    header = [metric, *extra, *(f"{metric} {k.removeprefix('by_')}={v}" for k in by_keys
                                for v in sorted({v for _, r in rows if r for v in r.get(k, {})}))]
    lines += ["## Held-out results", "", "| policy | " + " | ".join(header) + " | calls/episode | n |",
              "| --- " * (len(header) + 3) + "|"]
    for name, r in rows:
        if r:
            cells = [f"{r['score']:.3f}", *(f"{r[k]:.3f}" if k in r else "" for k in extra)]
            for k in by_keys:
                for v in sorted({v for _, r2 in rows if r2 for v in r2.get(k, {})}):
                    cell = r.get(k, {}).get(v)
                    cells.append(f"{cell['score']:.3f} (n={cell['n']})" if cell else "")
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {r.get('calls_per_episode', 0.0):.2f} | {r['n']} |")
    if phases.get("final_without_tools"):
        r = phases["final_without_tools"]
        lines += ["", f"The final policy with every tool disabled (same prompt, each call fails): {metric} "
                      f"**{r['score']:.3f}** (n={r['n']}); near Base Tool Call's, the tasks are not answerable from memory."]
    if phases.get("final_transfer"):
        r = phases["final_transfer"]
        by = "; ".join(f"{k.removeprefix('by_')}={v}: {c['score']:.3f} (n={c['n']})"
                       for k in sorted(x for x in r if x.startswith("by_")) for v, c in sorted(r[k].items()))
        lines += ["", f"The final policy on transfer tasks, harder than any trained on: {metric} **{r['score']:.3f}** "
                      f"(n={r['n']}{'; ' + by if by else ''})."]
    lines += failure_table([*rows, ("After RL, tools disabled", phases.get("final_without_tools")),
                            ("After RL, transfer tasks", phases.get("final_transfer"))])
    if base.get("base_tool_call") and phases.get("final"):
        lines += ["", f"{metric} gain over Base Tool Call: **{phases['final']['score'] - base['base_tool_call']['score']:+.3f}**"]
    if sft_phase and phases.get("final") and rl_ran:
        lines.append(f"{metric} gain of the RL phase over the SFT-only checkpoint: **{phases['final']['score'] - sft_phase['score']:+.3f}**")
        paired = paired_comparison(eval_records(run, "sft", sft_phase), eval_records(run, "final", phases["final"]))
        if paired:
            lines.append(f"Question by question (same {paired['n']} held-out questions): RL right where SFT was wrong "
                         f"{paired['gained']}, SFT right where RL is wrong {paired['lost']}; exact two-sided sign test "
                         f"p = {paired['p_value']:.3g}.")
        for key, by_value in paired_by(run, ("sft", sft_phase), ("final", phases["final"])).items():
            for value, p in by_value.items():
                lines.append(f"- {key.removeprefix('num_')} = {value} ({p['n']} questions): RL gained {p['gained']}, "
                             f"lost {p['lost']}, p = {p['p_value']:.3g}")
    if rl:
        total_wait = sum(r.get("time/wait_s", 0) for r in rl)
        total_compute = sum(r.get("time/compute_s", 0) for r in rl)
        total_publish = sum(r.get("time/publish_stall_s", 0) for r in rl)
        lines += ["", "## RL phase", "",
                  f"- optimizer steps: {rl[-1]['step']} (versions include the SFT steps)",
                  f"- learner time: waiting for data {total_wait:.0f} s, computing {total_compute:.0f} s, "
                  f"stalled by weight publishing {total_publish:.0f} s",
                  f"- learner restarts: {phases.get('rl', {}).get('learner_restarts', 0)}"]
    if actor:
        a = actor[-1]
        lines.append(f"- actor: {a['num_episodes_finished']} episodes ({a['num_episodes_failed']} failed), "
                     f"{a['num_groups_emitted']} groups, {a['num_turns']} turns in {a['elapsed_s'] / 60:.1f} min")
        lines += signal_lines(a, phases.get("rl", {}), phases.get("final"))
    lines += time_table(phases, evals)
    lines += ["", "## Plots", ""]
    for title, name in images:
        if name:
            lines += [f"### {title}", "", f"![{title}](plots/{name})", ""]
    path = run / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


if __name__ == "__main__":
    print(write_report(sys.argv[1]))
