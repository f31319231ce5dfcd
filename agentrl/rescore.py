"""`agentrl rescore RUN_DIR --config F`: score a run's stored episodes again with the environment in F.

For changing a reward without training again: every episode the run kept (each held-out
evaluation's, RUN_DIR/evals/*.text.jsonl.gz, and the RL groups the actor sent,
RUN_DIR/actor/episodes.jsonl) is given to the `reward(task, episode)` of F's environment as it was
played: the same tokens, answer and tool calls with their stored results. No model is called and no
tool runs. Old and new scores are printed side by side per evaluation, then one JSON line. The run
directory is never written.

Exit 2, naming what, when F's environment cannot load, a file holds a line that does not parse, or
`reward()` raises on an episode (with the last frame of its traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

from agentrl.common.config import ConfigError


class RescoreError(Exception):
    """What stops a re-score; the message names the file, the episode or the environment."""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl rescore", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run directory (agentrl train --out)")
    parser.add_argument("--config", default=None, help="TOML whose [env] scores the episodes (default: the run's own config.toml)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="override one key after --config (repeatable)")
    args = parser.parse_args(argv)
    run = Path(args.run_dir)
    try:
        rows = rescore(run, args.config if args.config is not None else str(run / "config.toml"), args.sets)
    except (RescoreError, ConfigError, FileNotFoundError) as err:
        print(f"agentrl rescore: {err}", file=sys.stderr)
        return 2
    for row in rows:
        print(f"{row['label']:<28} {row['n']:>4} episodes  {row['old_metric']} {row['old']:.4f} -> "
              f"{row['metric']} {row['new']:.4f}  "
              f"({row['gained']} up, {row['lost']} down)")
    print(json.dumps({"run_dir": str(run), "evaluations": rows}))
    return 0


def load_env(config_path: str, sets: list[str]):
    """F's environment, built as a run builds it (its chat from the config's model) but without tools."""
    from transformers import AutoTokenizer

    from agentrl.common.model import resolve_model
    from agentrl.engine.chat import ChatFormat
    from agentrl.engine.environments import make_env
    from agentrl.runconfig import load_run_config

    config = load_run_config(config_path, sets).config
    model_dir = resolve_model(config.model_dir or None)
    try:
        return make_env(ChatFormat(AutoTokenizer.from_pretrained(model_dir)), config.env)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's environment class: whatever its constructor raises is named
        raise RescoreError(f"env.class: {config.env.env_class!r} did not load: {type(err).__name__}: {err}") from err


def episode_state(record: dict, where: str):
    """The finished episode a record holds, as `reward()` saw it (engine.env.EpisodeState)."""
    from agentrl.common.records import trajectory_of
    from agentrl.engine.env import CallRecord, EpisodeState
    from agentrl.engine.task import Task, TaskError

    try:
        traj = trajectory_of(record)
        task = Task.from_json(record["task"], where)
        calls = [CallRecord(**c) for c in record["calls"]]
        messages = [tuple(m) for m in record["messages"]]
    except (KeyError, TypeError, ValueError, TaskError) as err:
        raise RescoreError(f"{where}: not an episode record this version can read ({type(err).__name__}: {err})") from None
    return EpisodeState(task=task, token_ids=traj.token_ids.tolist(), is_action=traj.is_action.tolist(),
                        logprobs=traj.behavior_logprobs.tolist(), versions=traj.policy_versions.tolist(),
                        prompt_len=traj.prompt_len, messages=messages, turns=traj.turns, done=True,
                        status=traj.status, error=traj.error, answer=record.get("answer"), calls=calls,
                        task_reward=traj.task_reward, metrics=dict(traj.metrics))


def score(env, record: dict, where: str) -> float:
    """The environment's score (its `score_metric`) of the stored episode; 0 for a failed one, as
    an evaluation counts it."""
    from agentrl.check import last_frame

    state = episode_state(record, where)
    if state.status == "failed":
        return 0.0
    try:
        reward = env.reward(state.task, state)
    except Exception as err:  # noqa: BLE001 - the user's reward(): named with its last frame
        raise RescoreError(f"{where}: reward() raised: {last_frame(''.join(traceback.format_exception(err)))}") from err
    metrics = dict(reward.metrics)
    if env.score_metric not in metrics:
        raise RescoreError(f"{where}: score_metric = {env.score_metric!r} is not among the metrics reward() returns "
                           f"({', '.join(sorted(metrics)) or 'none'})")
    return float(metrics[env.score_metric])


def _files(run: Path) -> list[tuple[str, Path]]:
    evals = sorted((run / "evals").glob("*.text.jsonl.gz")) if (run / "evals").is_dir() else []
    files = [(p.name.removesuffix(".text.jsonl.gz"), p) for p in evals]
    actor = run / "actor" / "episodes.jsonl"
    if actor.is_file():
        files.append(("rl groups (sampled)", actor))
    return files


def rescore(run: Path, config_path: str, sets: list[str]) -> list[dict]:
    """One row per evaluation file (and one for the RL groups): episodes, old and new mean score."""
    from agentrl.common.records import read_json_lines

    if not (run / "config.toml").is_file() or not (run / "evals").is_dir():
        raise RescoreError(f"{run} is not a run directory (it needs config.toml and evals/, as agentrl train writes)")
    files = _files(run)
    if not files:
        raise RescoreError(f"{run}: no stored episodes (evals/*.text.jsonl.gz, actor/episodes.jsonl)")
    env = load_env(config_path, sets)
    summaries, _ = read_json_lines(run / "evals.jsonl") if (run / "evals.jsonl").is_file() else ([], 0)
    # The old scores are in the metric the run reported (F's may be new or renamed).
    old_metric = next((s["score_metric"] for s in summaries if "score_metric" in s), env.score_metric)
    rows = []
    for label, path in files:
        lines, skipped = read_json_lines(path)
        if skipped:
            raise RescoreError(f"{path}: {skipped} line(s) do not parse as JSON objects")
        records = [e for line in lines for e in line["episodes"]] if path.name == "episodes.jsonl" else lines
        old, new, gained, lost = [], [], 0, 0
        for i, record in enumerate(records):
            where = f"{path.name} episode {i} (task {record.get('task_id')!r})"
            if "segments" not in record:
                raise RescoreError(f"{where}: no token record (written by an older agentrl: only its text was kept)")
            before = float(record.get("metrics", {}).get(old_metric, 0.0)) if record.get("status") != "failed" else 0.0
            after = score(env, record, where)
            old.append(before)
            new.append(after)
            gained += after > before
            lost += after < before
        n = len(records)
        rows.append({"label": label, "file": str(path.relative_to(run)), "n": n, "old_metric": old_metric,
                     "metric": env.score_metric,
                     "old": sum(old) / n if n else 0.0, "new": sum(new) / n if n else 0.0,
                     "gained": gained, "lost": lost})
    return rows
