"""What a running `agentrl train` shows: a status line every ~30 s, a progress bar on a terminal,
held-out scores and actor statistics in TensorBoard (and W&B when asked).

The status line is built only from files the run's processes write anyway (the learners'
metrics.jsonl, the actor's stats.jsonl) and from the supervisor's own state (phase, last
evaluation, deadline), so it costs the run nothing and cannot disagree with the record:

    [12.3 min] rl | step 34 | 412 episodes | task reward 0.41, 1.3 calls/episode (last 5 steps) | held-out EM 0.302 (sft) | 14.1 min left
    [4.0 min] sft | step 12 | SFT loss 0.412 (last 5 steps) | evaluating sft: 37/96 episodes | 20.5 min left

In the SFT phase the loss stands where RL shows its reward (the demonstrations' reward is always
the same); during a held-out evaluation, its progress in episodes.

TensorBoard (RUN_DIR/tensorboard): `heldout/em`, `heldout/f1`, `heldout/em_<n>hop`, ... per
evaluation (x = the policy version served), `actor/*` counters (x = seconds since the RL phase
began). The learners write their own per-step scalars under RUN_DIR/{sft,rl}/tensorboard.
W&B (`[logging] wandb = true`): the same values; `wandb_mode = "offline"` needs no network.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from agentrl.report import signal_text
from agentrl.runconfig import LoggingConfig

TAIL_BYTES = 256 * 1024
"""How much of a growing JSONL file the status line reads (its last records)."""


def tail_records(path: Path, num: int) -> list[dict]:
    """The last `num` complete JSON records of a JSONL file ([] when it does not exist)."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - TAIL_BYTES))
        lines = f.read().splitlines()
    if size > TAIL_BYTES:
        lines = lines[1:]  # the first may be cut
    out = []
    for line in reversed(lines):
        if len(out) == num:
            break
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the line being written right now; the next status line reads it whole
    return out[::-1]


def _mean(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), int | float)]
    return sum(values) / len(values) if values else None


class Progress:
    def __init__(self, out: Path, config: LoggingConfig, run_config: dict[str, Any] | None = None, *, stream=None):
        self.out = out
        self.config = config
        self.stream = stream or sys.stdout
        self.phase = "set-up"
        self.start = time.monotonic()
        self.deadline: float | None = None
        self.last_eval: dict | None = None
        self.eval_progress: tuple[str, int, int] | None = None
        """(label, episodes done, total) of the held-out evaluation running now, set by the supervisor."""
        self._actor_t0: float | None = None
        self._task: asyncio.Task | None = None
        self._tb = None
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(out / "tensorboard"))
        self._wandb = None
        if config.wandb:
            import wandb  # optional dependency: `pip install agentrl[wandb]`

            self._wandb = wandb.init(project=config.wandb_project, dir=str(out), mode=config.wandb_mode,
                                     config=run_config or {}, name=out.name)
        self._bar = None
        use_bar = config.progress_bar == "on" or (config.progress_bar == "auto" and self.stream.isatty())
        if use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=1, unit="min", file=self.stream, dynamic_ncols=True, desc="run", leave=False,
                             bar_format="{desc} {bar} {percentage:3.0f}% {postfix}")

    # -- what the supervisor tells it
    def set_phase(self, phase: str) -> None:
        self.phase = phase
        if phase == "rl":
            self._actor_t0 = time.monotonic()
        self.say(f"[{self._elapsed_min():.1f} min] phase: {phase}")

    def log_eval(self, summary: dict) -> None:
        self.last_eval = summary
        step = int(summary.get("served_version", 0))
        scalars = {f"heldout/{k}": v for k, v in summary.items()
                   if isinstance(v, int | float) and not isinstance(v, bool) and k not in ("time", "served_version", "n")}
        for key in (k for k in summary if k.startswith("by_")):
            for value, cell in summary[key].items():
                scalars[f"heldout/score_{key.removeprefix('by_')}_{value}"] = cell["score"]
        scalars["heldout/eval_s"] = summary.get("eval_s", 0.0)
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key if summary["label"] in ("sft", "rl", "final") else f"{key}/{summary['label']}",
                                    float(value), step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({**{f"{k}/{summary['label']}": v for k, v in scalars.items()}, "heldout/version": step})

    def say(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    # -- the status line
    def status_line(self) -> str:
        parts = [f"[{self._elapsed_min():.1f} min] {self.phase}"]
        learner_dir = self.out / ("rl" if self.phase in ("rl", "final evaluation") else "sft")
        recent = tail_records(learner_dir / "metrics.jsonl", 5)
        if recent:
            parts.append(f"step {recent[-1].get('step')}")
        actor = tail_records(self.out / "actor" / "stats.jsonl", 1)
        if actor and self.phase != "sft":
            parts.append(f"{actor[-1].get('num_episodes_finished', 0)} episodes")
        if self.phase == "sft":  # its batches are demonstrations: their reward says nothing, the loss does
            loss = _mean(recent, "loss")
            if loss is not None:
                parts.append(f"SFT loss {loss:.3f} (last {len(recent)} steps)")
        else:
            reward, calls = _mean(recent, "reward/task"), _mean(recent, "episode/num_tool_calls")
            if reward is not None:
                parts.append(f"task reward {reward:.2f}" + (f", {calls:.1f} calls/episode" if calls is not None else "")
                             + f" (last {len(recent)} steps)")
        if actor and self.phase == "rl":
            parts += signal_text(actor[-1])
        if self.eval_progress is not None:
            label, done, total = self.eval_progress
            parts.append(f"evaluating {label}: {done}/{total} episodes")
        if self.last_eval is not None:
            e = self.last_eval
            parts.append(f"held-out {e.get('score_metric', 'score')} {e['score']:.3f} ({e['label']})"
                         + (", at ceiling" if e["score"] >= 1.0 else ""))
        if self.deadline is not None:
            parts.append(f"{max(self.deadline - time.monotonic(), 0) / 60:.1f} min left")
        return " | ".join(parts)

    def _elapsed_min(self) -> float:
        return (time.monotonic() - self.start) / 60

    def _actor_scalars(self) -> None:
        if self._actor_t0 is None:
            return
        actor = tail_records(self.out / "actor" / "stats.jsonl", 1)
        if not actor:
            return
        x = int(time.monotonic() - self._actor_t0)
        scalars = {f"actor/{k}": v for k, v in actor[-1].items()
                   if isinstance(v, int | float) and not isinstance(v, bool) and k not in ("time", "elapsed_s")}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, x)
        if self._wandb is not None:
            self._wandb.log({**scalars, "actor/seconds": x})

    def _tick(self) -> None:
        if self._bar is not None and self.deadline is not None:
            total = max(self.deadline - self.start, 1.0)
            self._bar.total = round(total / 60, 1)
            self._bar.n = round(min(time.monotonic() - self.start, total) / 60, 1)
            self._bar.set_postfix_str(self.status_line().split(" | ", 1)[-1], refresh=True)

    async def _loop(self) -> None:
        next_line = time.monotonic() + self.config.status_every_s
        while True:
            await asyncio.sleep(min(self.config.status_every_s, 2.0))
            self._tick()
            if time.monotonic() >= next_line:
                next_line += self.config.status_every_s
                self.say(self.status_line())
                self._actor_scalars()

    def start_loop(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="progress")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=5.0)
            self._task = None
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
