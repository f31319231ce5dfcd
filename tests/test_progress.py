"""What a running `agentrl train` shows: the status line from the run's own files, held-out scores
and actor statistics in TensorBoard, W&B in offline mode."""

from __future__ import annotations

import asyncio
import io
import json
import re
import time

import pytest

from agentrl.progress import Progress, tail_records
from agentrl.runconfig import LoggingConfig


def _run_files(out):
    (out / "rl").mkdir(parents=True)
    (out / "actor").mkdir()
    with open(out / "rl" / "metrics.jsonl", "w") as f:
        for step in range(1, 8):
            f.write(json.dumps({"step": step, "reward/task": 0.1 * step, "episode/num_tool_calls": 1.0 + step / 10}) + "\n")
        f.write('{"step": 8, "reward/ta')  # a record being written right now
    (out / "actor" / "stats.jsonl").write_text(json.dumps({"num_episodes_finished": 412, "num_turns": 900}) + "\n")


def _event_scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_status_line_reads_the_run_files(tmp_path):
    _run_files(tmp_path)
    progress = Progress(tmp_path, LoggingConfig(tensorboard=False), stream=io.StringIO())
    progress.phase = "rl"
    progress.deadline = time.monotonic() + 600
    progress.log_eval({"label": "sft", "score": 0.302, "score_metric": "em", "em": 0.302, "f1": 0.4, "served_version": 12,
                       "eval_s": 40.0})
    line = progress.status_line()
    assert " rl | step 7 | 412 episodes | " in line
    # Mean over the last 5 complete records (steps 3-7): reward 0.5, calls 1.5; the cut line is skipped.
    assert "task reward 0.50, 1.5 calls/episode (last 5 steps)" in line
    assert "held-out em 0.302 (sft)" in line
    assert re.search(r"\| (10\.0|9\.9) min left$", line), line


def test_tail_records_reads_only_the_end_of_a_long_file(tmp_path):
    path = tmp_path / "m.jsonl"
    with open(path, "w") as f:
        for i in range(20000):
            f.write(json.dumps({"step": i, "pad": "x" * 40}) + "\n")
    assert [r["step"] for r in tail_records(path, 3)] == [19997, 19998, 19999]
    assert tail_records(tmp_path / "missing.jsonl", 3) == []


def test_status_lines_on_schedule_and_scores_in_tensorboard(tmp_path):
    _run_files(tmp_path)
    stream = io.StringIO()

    async def run():
        progress = Progress(tmp_path, LoggingConfig(status_every_s=0.3), stream=stream)
        progress.start_loop()
        progress.set_phase("rl")
        progress.log_eval({"label": "rl", "score": 0.25, "score_metric": "em", "em": 0.25, "f1": 0.5, "em_2hop": 0.1,
                           "served_version": 30, "eval_s": 9.0})
        await asyncio.sleep(2.0)
        await progress.close()

    asyncio.run(run())
    lines = [line for line in stream.getvalue().splitlines() if " | " in line]
    assert len(lines) >= 3, stream.getvalue()  # every 0.3 s
    scalars = _event_scalars(tmp_path / "tensorboard")
    assert scalars["heldout/em"] == [(30, 0.25)]
    assert scalars["heldout/em_2hop"] == [(30, pytest.approx(0.1))]
    assert scalars["actor/num_episodes_finished"][0][1] == 412


def test_wandb_offline_needs_no_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    progress = Progress(tmp_path, LoggingConfig(tensorboard=False, wandb=True, wandb_mode="offline"), {"minutes": 1.0},
                        stream=io.StringIO())
    progress.log_eval({"label": "final", "score": 0.4, "score_metric": "em", "served_version": 3, "eval_s": 1.0})
    asyncio.run(progress.close())
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_status_line_shows_the_sft_loss_and_an_evaluation_in_progress(tmp_path):
    (tmp_path / "sft").mkdir()
    with open(tmp_path / "sft" / "metrics.jsonl", "w") as f:
        for step, loss in enumerate((1.2, 1.0, 0.8), start=1):  # demonstrations: reward 1.0 at every step
            f.write(json.dumps({"step": step, "loss": loss, "reward/task": 1.0, "episode/num_tool_calls": 1.5}) + "\n")
    progress = Progress(tmp_path, LoggingConfig(tensorboard=False), stream=io.StringIO())
    progress.phase = "sft"
    line = progress.status_line()
    assert " sft | step 3 | SFT loss 1.000 (last 3 steps)" in line and "task reward" not in line, line
    progress.eval_progress = ("sft", 37, 96)
    assert "| evaluating sft: 37/96 episodes" in progress.status_line()
    progress.eval_progress = None
    assert "evaluating" not in progress.status_line()
