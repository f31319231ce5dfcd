"""The run's held-out evaluations: run, recorded (RUN_DIR/evals.jsonl, per-task files under
RUN_DIR/evals/), and reused when the served weights are the ones an earlier evaluation measured."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from agentrl.budget import CLEAN_EVALUATIONS
from agentrl.common.files import read_jsonl
from agentrl.common.records import write_episode_records
from agentrl.engine.evaluation import evaluate


def write_sample(path: Path, trajectories, chat) -> None:
    """A few episodes, decoded, for reading (RUN_DIR/trajectories_*.jsonl)."""
    with open(path, "w") as f:
        for t in trajectories:
            f.write(json.dumps({"task_id": t.task_id, "status": t.status, "task_reward": t.task_reward, "metrics": t.metrics,
                                "text": chat.decode(t.token_ids.tolist())}) + "\n")


class Evaluations:
    """Every held-out evaluation of the run, oldest first (`summaries`): read back on --resume, then
    appended by `record`."""

    def __init__(self, out: Path, *, resume: bool, say: Callable[[str], None] = print):
        self.out, self.say = out, say
        self.summaries: list[dict] = read_jsonl(out / "evals.jsonl") if resume else []
        self.first_of_this_process = len(self.summaries)
        """Evaluations before this index were read back on --resume: another server process measured
        them (a resumed run's fresh server serves version 0 until a learner pushes), and another
        slice of the budget paid for them."""
        self.conn = None
        """The run's connections (engine/services.py `Connections`), once its services answer."""
        self.episodes = None
        """The `[agent]` runner held-out evaluations use (None: native episodes)."""
        self.heldout: list = []
        self.task_metadata: dict[str, dict] = {}
        """task id -> metadata, for grouping per-task results (the environment's `report_by`)."""
        self.on_progress: Callable[[tuple[str, int, int] | None], None] = lambda progress: None
        """Told (label, done, total) while an evaluation runs, and None after it."""

    @property
    def of_this_process(self) -> list[dict]:
        return self.summaries[self.first_of_this_process:]

    def record(self, summary: dict, trajectories: list | None = None) -> None:
        """Append `summary` to RUN_DIR/evals.jsonl and, with its `trajectories`, write the per-task
        results (for the report's task-by-task comparisons) and every episode's text."""
        self.summaries.append(summary)
        with open(self.out / "evals.jsonl", "a") as f:
            f.write(json.dumps(summary) + "\n")
        if trajectories is None:
            return
        folder = self.out / "evals"
        folder.mkdir(exist_ok=True)
        name = f"{summary['label']}-v{summary['served_version']}.jsonl"
        metric = summary["score_metric"]
        report_by = self.conn.env.report_by if self.conn is not None else ()
        with open(folder / name, "w") as f:
            for t in sorted(trajectories, key=lambda t: t.task_id):
                meta = self.task_metadata.get(t.task_id, {})
                f.write(json.dumps({"task_id": t.task_id, "score": t.metrics.get(metric, 0.0), "status": t.status,
                                    **{k: v for k, v in t.metrics.items() if "/" not in k},
                                    "group": {k: str(meta[k]) for k in report_by if k in meta}}) + "\n")
        if self.conn is not None:  # every episode's record (agentrl/common/records.py): view, rescore
            write_episode_records(folder / name.replace(".jsonl", ".text.jsonl.gz"), trajectories, self.conn.chat)

    async def run(self, tasks, label: str, env=None) -> tuple[dict, list]:
        """`evaluate` (engine/evaluation.py) on `tasks`; `env`: another environment (a diagnostic),
        which runs native episodes."""
        try:
            return await evaluate(self.conn, tasks, label, env=env, episodes=None if env is not None else self.episodes,
                                  on_progress=lambda done, total: self.on_progress((label, done, total)))
        finally:
            self.on_progress(None)

    async def of_policy(self, label: str) -> tuple[dict, list | None]:
        """The held-out evaluation `label` of the served policy, unless the latest clean evaluation
        (baseline, after SFT, final) of this process measured the same served version on the whole
        held-out set (not a baseline on a subset, `eval.baseline_questions`): the same weights,
        prompt, tasks and greedy decoding give the same result, so that one is reused (its per-task
        files copied under this label) and nothing runs: (that summary, None) is returned then."""
        versions = list((await self.conn.pool.weight_versions()).values())
        served = max(versions) if versions else -1
        same = [e for e in self.of_this_process
                if e.get("label") in CLEAN_EVALUATIONS and e.get("served_version") == served and "subset_of" not in e
                and e.get("harness", "native") == ("native" if self.episodes is None else "agent")]
        if not same:
            return await self.run(self.heldout, label)
        earlier = same[-1]
        folder = self.out / "evals"
        for suffix in (".jsonl", ".text.jsonl.gz"):
            source = folder / f"{earlier['label']}-v{served}{suffix}"
            if source.is_file():
                shutil.copyfile(source, folder / f"{label}-v{served}{suffix}")
        self.say(f"evaluation {label} not run: served version {served} is the one the {earlier['label']} evaluation "
                 "measured (same weights, prompt, tasks, greedy decoding); its result stands")
        return {**earlier, "label": label, "time": time.time(), "repeat_of": earlier["label"]}, None


def eval_line(summary: dict) -> str:
    """The one line an evaluation's result is said in."""
    extra = f"  F1 {summary['f1']:.3f}" if "f1" in summary else ""
    return (f"[eval {summary['label']}] {summary['score_metric']} {summary['score']:.3f}{extra}  n={summary['n']} "
            f"(served version {summary['served_version']}, {summary['eval_s']:.0f} s)")
