"""The main job's time-budget rules (`agentrl train`). `minutes` covers everything after set-up. Three
rules keep a run inside it; they are functions of the evaluation summaries so that they can be
tested without starting a run."""

from __future__ import annotations

import math

CLEAN_EVALUATIONS = ("base_tool_call", "sft", "final")
"""Evaluations of the policy with the server to itself (RL-phase ones share it with the actor;
baselines such as Naive RAG run other, shorter episodes)."""


MIN_SFT_PHASE_S = 90.0
"""Below this much time for the SFT cold start it is skipped: a learner takes ~20-30 s to start, and
a step of the default's ~30 s on the slower machine kind; a cold start stopped before its first step
would leave RL no checkpoint to start from."""
MIN_RL_PHASE_S = 60.0
"""Below this much time before the final evaluation the RL phase is not started: starting a learner
and an actor alone takes ~20-30 s, and a step more on the slower machine kind."""


def rl_shortfall_message(rl_s: float, rl_min_share: float, minutes: float) -> str:
    """What a run says before an RL phase shorter than rl_min_share of the budget: how much more
    time RL needs on this machine and the --minutes that gives it."""
    need_s = rl_min_share * minutes * 60
    more_min = (need_s - max(rl_s, 0.0)) / 60
    return (f"warning: the RL phase gets {max(rl_s, 0) / 60:.1f} minutes, less than rl_min_share = {rl_min_share} of the "
            f"{minutes:g}-minute budget ({need_s / 60:.1f} minutes): what came before it (evaluations, the SFT cold start) "
            f"took the rest on this machine. This machine needs about {more_min:.0f} more minutes for RL; use "
            f"--minutes {math.ceil(minutes + more_min)}")


def eval_extends_deadline_s(summary: dict, *, in_budget: bool) -> float:
    """Seconds an evaluation adds to the deadline. With evaluations outside the budget the
    before/after evaluations (sft, final) are added back; an RL-phase evaluation is not, because
    training goes on beside it. The baseline evaluations run before the budget starts. One that did
    not run (cached, or reused for an unchanged policy) adds nothing."""
    if in_budget or summary["label"] not in ("sft", "final") or summary.get("cached") or summary.get("repeat_of"):
        return 0.0
    return float(summary["eval_s"])


def evenly_spaced(items: list, n: int) -> list:
    """`n` of `items` at evenly spaced positions, in order (all of them when n is 0 or >= len)."""
    if n <= 0 or n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def final_eval_reserve_s(evals: list[dict], *, in_budget: bool) -> float:
    """Time the RL phase leaves before the deadline: stopping the RL processes (the learner
    checkpoints on SIGTERM: ~10 s) and the final evaluation, i.e. 1.25 x the latest evaluation that
    had the server to itself (after SFT, else the baseline; RL-phase evaluations share the server
    with the actor and run slower; Naive RAG generates one turn only), plus 30 s; 120 s stand in for
    an evaluation when none ran yet. A baseline on a subset of the held-out tasks (`subset_of`)
    counts scaled by the square root of the whole set's size over the subset's: the episodes run
    concurrently, and a larger batch uses the server better. The one measurement behind it (slower
    kind, issue 40, rewards alone): the untrained policy's 16 episodes took 168 s, 2.7 s per turn,
    and the RL policy's 64 took 252 s, 1.4 s per turn (different policies, so batch size and policy
    are not separated); scaled linearly, the reserve of 871 s left 9 of the run's 32 minutes unused,
    and with the square root the next run (seed 1) used 31.0 of them. 0 when evaluations are outside
    the budget."""
    if not in_budget:
        return 0.0
    durations = [e["eval_s"] * math.sqrt(e.get("subset_of", e["n"]) / e["n"]) for e in evals
                 if e.get("label") in CLEAN_EVALUATIONS and "eval_s" in e]
    return 1.25 * (durations[-1] if durations else 120.0) + 30.0


def sft_stop_at(now_s: float, max_minutes: float, deadline_s: float, reserve_s: float) -> float:
    """When the SFT cold start is stopped if its steps are not done by then: after `max_minutes`
    (0: no limit of its own), and at the latest when only `reserve_s` (the final evaluation's) is left
    before the deadline."""
    limit = deadline_s - reserve_s
    return min(limit, now_s + max_minutes * 60) if max_minutes > 0 else limit


def rl_eval_fits(now_s: float, evals: list[dict], *, next_eval_s: float, rl_end_s: float, in_budget: bool,
                 max_eval_s: float = math.inf) -> bool:
    """Whether to start an RL-phase evaluation now: it is due, 1.25 x the last RL-phase one still
    ends before the RL phase does, and the evaluations so far, this one and the final one's reserve
    stay within `max_eval_s` (eval.max_share of the budget). Before the first, the final-evaluation
    reserve stands in for it (an RL-phase evaluation runs beside the actor and the learner, so longer
    than a clean one)."""
    from agentrl.report import evaluation_seconds

    rl_durations = [e["eval_s"] for e in evals if e.get("label") == "rl" and "eval_s" in e]
    reserve_s = final_eval_reserve_s(evals, in_budget=in_budget)
    expected_s = 1.25 * (rl_durations[-1] if rl_durations else reserve_s)
    within_share = evaluation_seconds(evals) + expected_s + reserve_s <= max_eval_s
    return now_s >= next_eval_s and now_s + expected_s < rl_end_s and within_share
