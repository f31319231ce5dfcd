"""The main job end to end, with faults: `agentrl train` on a small budget, real processes.

One run covers what CI must guard: the supervisor starts two search replicas, a vLLM server, an
SFT learner, then the RL learner and the actor; the test SIGKILLs one search replica and the RL
learner mid-run: the run restarts the learner (which resumes from its checkpoint and spool). Then
it SIGKILLs `agentrl train` itself: within 10 s no process of the run may be left (the watchdog),
and `--resume` must finish the run (with two vLLM servers, `services.vllm_replicas`: both take the
learner's weights and serve episodes, each on cores of its own) and print its JSON line. The final ledger must show every group
trained exactly once: the metrics of the surviving lineage list each group id at one step only,
and those are the ledger's groups.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.runs import train_argv

from agentrl.common.proctable import all_processes, descendants, same_process
from agentrl.learner.checkpoint import checkpoint_dirs, checkpoint_step, load_latest_checkpoint

# Over tests/tiny_run.toml: the cold start, and through the learner's restart the SFT demonstrations
# trained beside each RL step (the anchor); two search replicas; the opt-in diagnostics after the
# budget, guarded here. The test kills the run mid-RL, so the budget is only an upper bound.
SETS = ("minutes=9.0", "tasks.options.transfer_num=3", "services.search_replicas=2", "sft.enabled=true",
        "learner.anchor.coef=0.1", "learner.anchor.tokens_per_step=512",
        "learner.trainer.advantage.dynamic_sampling=true", "eval.without_tools=true", "eval.transfer=true")



class LineReader:
    def __init__(self, stream):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith(prefix):
                    return line
            time.sleep(0.5)
        raise TimeoutError(f"no line starting with {prefix!r} within {timeout_s} s; got:\n" + "\n".join(self.lines[-30:]))


def _pid(line: str) -> int:
    return int(line.split("(pid ")[1].split(")")[0].split(",")[0])


def _metric_lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.run
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_train_survives_killed_search_replica_and_learner(tmp_path):
    # Started from one working directory with a relative --out, resumed from another with another
    # HOME (standing in for a second host that mounts the run directory).
    host_a, host_b, home_b = tmp_path / "host_a", tmp_path / "host_b", tmp_path / "home_b"
    for folder in (host_a, host_b, home_b):
        folder.mkdir()
    out = host_a / "run"
    proc = subprocess.Popen(
        train_argv(*SETS, out="run"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=host_a,
    )
    reader = LineReader(proc.stdout)
    try:
        replica_line = reader.wait_for("tool service search #1", 120)
        replica, replica_endpoint = _pid(replica_line), replica_line.split()[4]
        server = _pid(reader.wait_for("vLLM server: ", 600))
        learner = _pid(reader.wait_for("started learner-rl", 900))
        metrics = out / "rl" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and len(_metric_lines(metrics)) < 2:
            time.sleep(1.0)
        assert len(_metric_lines(metrics)) >= 2, "\n".join(reader.lines[-30:])
        os.kill(replica, signal.SIGKILL)
        os.kill(learner, signal.SIGKILL)
        os.killpg(server, signal.SIGKILL)  # the vLLM server's whole process group: started again at its URL
        url = reader.wait_for("vLLM server: ", 1).split()[2]
        reader.wait_for("the vLLM server exited with -9", 60)
        # The replica too, at its endpoint (its clients probe it and take it back).
        assert _pid(reader.wait_for(f"tool service tool-search-1: {replica_endpoint} again", 120)) != replica
        assert _pid(reader.wait_for(f"vLLM server: {url} again", 180)) != server
        reader.wait_for("learner exited with", 60)
        reader.wait_for("started learner-rl", 60)
        trained_before_restart = len(_metric_lines(metrics))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and len(_metric_lines(metrics)) <= trained_before_restart:
            time.sleep(1.0)
        assert len(_metric_lines(metrics)) > trained_before_restart, "\n".join(reader.lines[-30:])

        # SIGKILL the supervisor itself mid-RL: its watchdog stops every process of the run.
        run_processes = descendants({proc.pid}, all_processes())
        assert len(run_processes) >= 5, run_processes  # watchdog, vLLM, search replicas, learner, actor
        proc.kill()
        killed_at = time.monotonic()
        while (left := [i for i in run_processes.values() if same_process(i)]) and time.monotonic() - killed_at < 10:
            time.sleep(0.2)
        assert not left, f"10 s after SIGKILL of agentrl train, still alive: {left}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    # --resume finishes the run (a shorter budget for what is left), from the other "host": nothing
    # it needs may live in the first one's working directory or HOME (the model is prepared again
    # in the new HOME; the checkpoints, spool, ledger and anchor are in the run directory).
    # It resumes with two vLLM servers (services.vllm_replicas) where the run had one.
    # RL ends one step after the checkpoint it resumes from (the budget is only an upper bound).
    resume_step = checkpoint_step(checkpoint_dirs(out / "rl" / "checkpoints")[-1])
    resumed = subprocess.run([sys.executable, "-P", "-m", "agentrl.cli", "train", "--resume", "../host_a/run", "--set", "minutes=2.5",
                              "--set", "services.vllm_replicas=2", "--set", f"learner.max_steps={resume_step + 1}"],
                             capture_output=True, text=True, timeout=1500, cwd=host_b,
                             env={**{k: v for k, v in os.environ.items() if k != "AGENTRL_CACHE"}, "HOME": str(home_b)})
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    summary["report"], summary["hf"] = str((host_b / summary["report"]).resolve()), str((host_b / summary["hf"]).resolve())
    assert (home_b / ".cache" / "agentrl" / "models").is_dir()
    servers = [line.split()[2] for line in resumed.stdout.splitlines() if line.startswith("vLLM server: ")]
    assert len(set(servers)) == 2, resumed.stdout[-3000:]
    bound = set()
    for log in ("vllm-0.log", "vllm-1.log"):  # each took the learner's weights and served episodes
        text = (out / "logs" / log).read_text()
        assert "Reloading weights inplace" in text and re.search(r"Running: [1-9]\d* reqs", text), log
        bound.add(re.search(r"core ids=\[(.*?)\]", text).group(1))
    assert len(bound) == 2, bound  # on cores of their own (engine.serve.split_cores)
    assert summary["optimizer_steps"] >= 2 + 2  # SFT steps + RL steps across the restart
    assert summary["episodes"] > 0
    assert Path(summary["report"]).is_file()
    assert (out / "plots" / "heldout_score.png").is_file()

    # Exactly once in the surviving lineage: the last record written for each step (steps redone
    # after the restart overwrite the lost ones) lists each group id once, and they are the ledger's.
    state = load_latest_checkpoint(out / "rl" / "checkpoints")
    final_step = int(state["step"])
    last_record_of_step: dict[int, dict] = {}
    for record in _metric_lines(out / "rl" / "metrics.jsonl"):
        last_record_of_step[record["step"]] = record
    seen: list[str] = []
    for step, record in sorted(last_record_of_step.items()):
        if step <= final_step:
            seen += record.get("group_ids", [])
    assert len(seen) == len(set(seen)), "a group was trained at two steps"
    # The demonstration anchor: the cold start's demonstrations, in every RL step of both learners.
    assert len(list((out / "rl-anchor").glob("*.grp"))) == 16
    steps = [r for r in _metric_lines(out / "rl" / "metrics.jsonl") if "loss" in r]
    assert steps and all(0 < r["loss/anchor_nll"] < 20 for r in steps)
    assert set(seen) == set(state["ledger"]["trained"])
    assert all(state["ledger"]["trained"][gid] <= final_step for gid in seen)
    # The servers serve what the learner trained (a version of the RL lineage).
    evals = [json.loads(x) for x in (out / "evals.jsonl").read_text().splitlines()]
    final = next(e for e in reversed(evals) if e["label"] == "final")
    assert final["served_version"] > 2
    # Every evaluation episode's whole text is kept, compressed.
    final_texts = out / "evals" / f"final-v{final['served_version']}.text.jsonl.gz"
    with gzip.open(final_texts, "rt") as f:
        episodes = [json.loads(line) for line in f]
    assert len(episodes) == final["n"] and all(e["text"].startswith("<|im_start|>system") for e in episodes)
    # Then the same policy once more with its tools disabled: every call failed, none was answered.
    without_tools = next(e for e in evals if e["label"] == "final_without_tools")
    assert summary["em_after_without_tools"] == round(without_tools["em"], 4)
    with gzip.open(out / "evals" / f"final_without_tools-v{final['served_version']}.text.jsonl.gz", "rt") as f:
        texts = [json.loads(line)["text"] for line in f]
    assert len(texts) == final["n"]
    episode_parts = [t.rsplit("Question: ", 1)[1] for t in texts]  # after any worked example's tool responses
    # The tool-role messages only (what the environment sent): a `<tool_response>` block the policy
    # writes inside its own turn is its text, whatever it says.
    tool_messages = [m for p in episode_parts for m in re.findall(r"<\|im_start\|>tool\n(.*?)(?:<\|im_end\|>|$)", p, re.S)]
    blocks = [b for m in tool_messages for b in re.findall(r"<tool_response>\n(.*?)\n</tool_response>", m, re.S)]
    assert tool_messages and len(blocks) == len(tool_messages), tool_messages  # each tool message holds one result
    # Every tool message is an error: a call's answer says the tool is disabled; the others are the
    # environment's own (a turn with neither a call nor an answer, a malformed call).
    assert all(b.startswith('{"name": ') or b.startswith('{"error": ') for b in blocks), blocks
    assert all("disabled in this evaluation" in b for b in blocks if b.startswith('{"name": "search"'))
    assert "fail_stopped_early" in final and "fail_truncated" in final
    assert "with every tool disabled" in Path(summary["report"]).read_text()
    # And on the transfer tasks (3-hop, never trained on), after the budget: a figure in the JSON line.
    transfer = next(e for e in evals if e["label"] == "final_transfer")
    assert transfer["n"] == 3 and transfer["served_version"] == final["served_version"]
    assert summary["em_after_transfer"] == round(transfer["em"], 4) and "calls_after_transfer" in summary
    assert "transfer tasks, harder than any trained on" in Path(summary["report"]).read_text()

    # The run's end exported the policy; evaluated alone (a fresh server, the run's config from the
    # folder), it scores what the run's final evaluation did.
    assert summary["hf"] == str((out / "hf").resolve()) and (out / "hf" / "model.safetensors").is_file()
    eval_proc = subprocess.run([sys.executable, "-P", "-m", "agentrl.cli", "eval", "--model", str(out / "hf"), "--no-baselines"],
                               capture_output=True, text=True, timeout=900)
    assert eval_proc.returncode == 0, eval_proc.stderr[-3000:]
    exported = json.loads(eval_proc.stdout.strip().splitlines()[-1])
    assert exported["n"] == final["n"] and exported["em"] == final["em"], (exported, final)
