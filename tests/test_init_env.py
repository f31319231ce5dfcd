"""`agentrl init-env DIR`: the folder it writes passes `agentrl check` and trains as written (end to
end on the real vLLM server and learner, 3 minutes, from another working directory); it refuses a
folder that holds files. The run it trains is then re-scored (`agentrl rescore`) and opened in a real
headless browser (`agentrl view`)."""

from __future__ import annotations

import asyncio
import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.browser import Browser


def agentrl(*argv: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "agentrl.cli", *argv], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


def test_the_scaffold_passes_check_and_refuses_a_folder_with_files(tmp_path):
    made = agentrl("init-env", "shop", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in (tmp_path / "shop").iterdir()) == ["README.md", "config.toml", "environment.py", "tools.py"]
    readme = (tmp_path / "shop" / "README.md").read_text()
    assert "agentrl check --config shop/config.toml" in readme and "agentrl train --config shop/config.toml" in readme
    checked = agentrl("check", "--config", "shop/config.toml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert "tools: lookup from tools[0]" in checked.stdout and "ok: shop/config.toml is ready to train" in checked.stdout
    again = agentrl("init-env", "shop", cwd=tmp_path)
    assert again.returncode == 2 and "not an empty folder" in again.stderr
    assert (tmp_path / "shop" / "config.toml").read_text() == (
        Path(__file__).resolve().parents[1] / "agentrl" / "templates" / "env" / "config.toml").read_text()


@pytest.mark.run
@pytest.mark.slow
@pytest.mark.vllm
def test_the_scaffold_trains_as_written(tmp_path, shared_server):
    """init-env, check, then `agentrl train` from another folder on the session's server: the run's
    last line is its JSON summary with the scores (no learning target here). Only its size is cut:
    8 held-out tasks, 2 SFT steps and one RL step (without dynamic sampling, so that the step
    comes whatever the rewards), which ends the run before its budget."""
    assert agentrl("init-env", "envs/shop", cwd=tmp_path).returncode == 0
    assert agentrl("check", "--config", "envs/shop/config.toml", cwd=tmp_path).returncode == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = agentrl("train", "--config", "../envs/shop/config.toml", "--minutes", "8", "--out", "run",
                  "--vllm", shared_server.base_url, "--set", "tasks.options.num_heldout=8", "--set", "sft.steps=2",
                  "--set", "learner.max_steps=3", "--set", "learner.trainer.advantage.dynamic_sampling=false",
                  cwd=elsewhere, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["score_metric"] == "correct"
    assert summary["score_before"] is not None and summary["score_after"] is not None
    assert (elsewhere / "run" / "report.md").is_file()
    assert "tool service tools[0]" in run.stdout + run.stderr
    # The budget is an upper bound (on the slower kind 3 minutes ended before the RL step).
    assert summary["rl_steps"] + summary["sft_steps_done"] == 3 and "learner finished its max_steps" in run.stdout, \
        run.stdout[-3000:]
    run_dir = elsewhere / "run"
    before = _snapshot(run_dir)
    _rescore_checks(run_dir, tmp_path / "envs" / "shop")
    _view_checks(run_dir, tmp_path)
    assert _snapshot(run_dir) == before, "rescore or view wrote into the run directory"


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


LENIENT = """from agentrl.engine.env import Reward
from environment import CatalogueEnv


class LenientEnv(CatalogueEnv):
    def reward(self, task, episode):
        answered = float(episode.answer is not None)
        return Reward(answered, {"correct": answered})
"""


def _rescore_checks(run_dir: Path, env_dir: Path) -> None:
    """The run's own environment gives every stored episode the score it had; a changed reward
    (full marks for any answer) gives each the score its stored answer earns; no model, no tool."""
    same = agentrl("rescore", str(run_dir), cwd=env_dir)
    assert same.returncode == 0, same.stderr[-3000:]
    rows = json.loads(same.stdout.strip().splitlines()[-1])["evaluations"]
    evals = [r for r in rows if r["file"].startswith("evals/")]
    assert evals and any(r["label"] == "rl groups (sampled)" for r in rows), rows
    assert all(r["new"] == r["old"] and r["gained"] == r["lost"] == 0 for r in rows), rows
    reported = {json.loads(x)["label"]: json.loads(x) for x in (run_dir / "evals.jsonl").read_text().splitlines()}
    for row in evals:
        label = row["label"].rsplit("-v", 1)[0]
        assert abs(row["old"] - reported[label]["score"]) < 1e-9, (row, reported[label])

    (env_dir / "lenient.py").write_text(LENIENT)
    (env_dir / "lenient.toml").write_text((env_dir / "config.toml").read_text().replace(
        'class = "environment.py:CatalogueEnv"', 'class = "lenient.py:LenientEnv"'))
    changed = agentrl("rescore", str(run_dir), "--config", "lenient.toml", cwd=env_dir)
    assert changed.returncode == 0, changed.stderr[-3000:]
    for row in json.loads(changed.stdout.strip().splitlines()[-1])["evaluations"]:
        if not row["file"].startswith("evals/"):
            continue
        with gzip.open(run_dir / row["file"], "rt") as f:
            episodes = [json.loads(line) for line in f]
        answered = [e["status"] != "failed" and e["answer"] is not None for e in episodes]
        assert row["new"] == sum(answered) / len(episodes), row
        assert row["gained"] == sum(a and e["metrics"]["correct"] == 0 for a, e in zip(answered, episodes, strict=True))

    not_a_run = agentrl("rescore", str(env_dir), cwd=env_dir)
    assert not_a_run.returncode == 2 and "is not a run directory" in not_a_run.stderr


def _view_checks(run_dir: Path, tmp_path: Path) -> None:
    """The page of the real run in a real browser: the evaluations, an RL step, one trained episode
    with the policy's tokens marked (log-prob, version, advantage), and the same held-out question
    across evaluations."""
    view = subprocess.Popen([sys.executable, "-P", "-m", "agentrl.cli", "view", str(run_dir), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = view.stdout.readline().split()[-1]
        assert url.startswith("http://127.0.0.1:"), url
        started = time.monotonic()
        found = asyncio.run(_browse(url, tmp_path))
        print(f"browser part: {time.monotonic() - started:.1f} s")
    finally:
        view.terminate()
        assert view.wait(timeout=30) == 0, view.stderr.read()[-3000:]
    assert found["evaluations"] >= 2 and found["steps"] >= 1
    # A trained RL episode: every policy token has a log-prob <= 0, the version that sampled it and an advantage.
    tokens = found["rl_tokens"]
    assert tokens and all(float(t["logprob"]) <= 0 and int(t["version"]) >= 0 and t["adv"] is not None for t in tokens)
    assert "trained at step" in found["rl_trained"]
    # An evaluation episode: the policy's tokens carry the evaluated version, no advantage.
    assert found["eval_tokens"] and all(t["adv"] is None for t in found["eval_tokens"])
    assert {int(t["version"]) for t in found["eval_tokens"]} == {found["eval_version"]}
    assert 2 <= found["columns"] <= found["evaluations_with_episodes"]  # before and after training, at least


async def _browse(url: str, tmp_path: Path) -> dict:
    tokens_js = ("[...document.querySelectorAll('.tok.policy')].map(t => ({logprob: t.dataset.logprob, "
                 "version: t.dataset.version, adv: t.dataset.adv === undefined ? null : t.dataset.adv}))")
    found = {}
    async with Browser() as browser:
        await browser.open(url)
        found["evaluations"] = await browser.evaluate("document.querySelectorAll('#evaluations tr').length - 1")
        found["steps"] = await browser.evaluate("document.querySelectorAll('#steps tr a').length")
        eval_links = await browser.evaluate("[...document.querySelectorAll('#evaluations a')].map(a => a.href)")
        found["evaluations_with_episodes"] = len(eval_links)
        step_links = await browser.evaluate("[...document.querySelectorAll('#steps a')].map(a => a.href)")
        await browser.open(step_links[-1])
        episode_links = await browser.evaluate("[...document.querySelectorAll('a.episode-link')].map(a => a.href)")
        assert episode_links, "the last RL step lists no episode"
        await browser.open(episode_links[0])
        found["rl_tokens"] = await browser.evaluate(tokens_js)
        found["rl_trained"] = await browser.evaluate("document.querySelector('#trained').textContent")
        await browser.screenshot(tmp_path / "rl-episode.png")
        await browser.open(eval_links[-1])
        await browser.open(await browser.evaluate("document.querySelector('a.episode-link').href"))
        found["eval_tokens"] = await browser.evaluate(tokens_js)
        found["eval_version"] = int(eval_links[-1].rsplit("-v", 1)[1])
        await browser.open(eval_links[-1])
        question = await browser.evaluate("[...document.querySelectorAll('#episodes a')].find(a => a.href.includes('/question')).href")
        await browser.open(question)
        found["columns"] = await browser.evaluate("document.querySelectorAll('#question-columns > .column').length")
    return found
