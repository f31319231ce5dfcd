"""The run's episode records (agentrl/common/records.py) and `agentrl view`'s rules, without a run:
a record gives back the arrays the learner trained on; files still being written read up to their
last whole line; a folder that is not a run is refused with exit 2; on another address than
loopback every request needs the view's token. The page of a real run in a real browser, and
`agentrl rescore` on it, are in tests/test_init_env.py (after the scaffold's run)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from agentrl.common.records import episode_record, read_json_lines, trajectory_of
from agentrl.common.trajectory import Trajectory, Turn
from agentrl.engine.env import CallRecord
from agentrl.engine.task import Task
from agentrl.view import COOKIE, make_app


@pytest.fixture(scope="module")
def chat(model_dir):
    from transformers import AutoTokenizer

    from agentrl.engine.chat import ChatFormat

    return ChatFormat(AutoTokenizer.from_pretrained(model_dir))


def _trajectory(chat) -> Trajectory:
    prompt = chat.encode("<|im_start|>user\nWhat is 6 x 7?<|im_end|>\n<|im_start|>assistant\n")
    action1 = chat.encode('<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>') + [chat.im_end_id]
    obs = chat.encode("\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    action2 = chat.encode("<answer>42</answer>") + [chat.im_end_id]
    ids = prompt + action1 + obs + action2
    is_action = np.array([0] * len(prompt) + [1] * len(action1) + [0] * len(obs) + [1] * len(action2), dtype=np.uint8)
    rng = np.random.default_rng(0)
    logprobs = np.where(is_action == 1, -rng.random(len(ids)), 0.0).astype(np.float32)
    versions = np.where(is_action == 1, 3, -1).astype(np.int32)
    a1 = len(prompt)
    turns = [Turn(a1, a1 + len(action1), a1 + len(action1) + len(obs), {"valid_call": 0.1}, 1),
             Turn(a1 + len(action1) + len(obs), len(ids), len(ids), {}, 0)]
    return Trajectory(task_id="t1", group_id="g1", sample_index=2, token_ids=np.array(ids, dtype=np.int32),
                      is_action=is_action, behavior_logprobs=logprobs, policy_versions=versions, prompt_len=len(prompt),
                      turns=turns, task_reward=1.0, metrics={"em": 1.0, "fail_truncated": 0.0},
                      task=Task("t1", prompt="What is 6 x 7?", reference="42", metadata={"hops": 1}),
                      messages=[("user", "What is 6 x 7?", "")],
                      calls=[CallRecord(0, "python", {"code": "print(6*7)"}, True, {"stdout": "42\n"})], answer="42")


def test_a_record_gives_back_the_trained_arrays_the_text_and_the_calls(chat):
    traj = _trajectory(chat)
    record = json.loads(json.dumps(episode_record(traj, chat)))
    back = trajectory_of(record)
    for name in ("token_ids", "is_action", "policy_versions"):
        assert np.array_equal(getattr(back, name), getattr(traj, name)), name
    assert np.allclose(back.behavior_logprobs, traj.behavior_logprobs, atol=1e-5)
    assert [s["kind"] for s in record["segments"]] == ["prompt", "action", "observation", "action"]
    assert "".join(s["text"] for s in record["segments"]) == record["text"] == chat.decode(traj.token_ids.tolist())
    action = record["segments"][1]
    assert len(action["pieces"]) == len(action["logprobs"]) == len(action["versions"]) == traj.turns[0].action_end - traj.turns[0].action_start
    assert record["calls"] == [{"turn": 0, "name": "python", "arguments": {"code": "print(6*7)"}, "success": True,
                                "content": {"stdout": "42\n"}, "error": None, "repeated": False}]
    assert record["task"]["reference"] == "42" and record["answer"] == "42"
    record["segments"].pop()  # a record that does not hold together is refused
    with pytest.raises(ValueError, match="action segments"):
        trajectory_of(record)


def test_files_still_being_written_read_up_to_their_last_whole_line(tmp_path):
    plain = tmp_path / "a.jsonl"
    plain.write_text('{"a": 1}\n{"a": 2}\n{"a": ')
    assert read_json_lines(plain) == ([{"a": 1}, {"a": 2}], 1)
    plain.write_text('{"a": 1}\nnot json\n[1]\n')
    assert read_json_lines(plain) == ([{"a": 1}], 2)
    whole = gzip.compress(b'{"a": 1}\n{"a": 2}\n')
    cut = tmp_path / "b.jsonl.gz"
    cut.write_bytes(whole[: len(whole) - 6])  # a gzip stream not yet closed
    records, skipped = read_json_lines(cut)
    assert records in ([{"a": 1}], [{"a": 1}, {"a": 2}]) and skipped >= 1


def _run_dir(tmp_path: Path, chat) -> Path:
    run = tmp_path / "run"
    (run / "evals").mkdir(parents=True)
    (run / "config.toml").write_text("")
    summary = {"label": "final", "time": 1.0, "score": 1.0, "score_metric": "em", "n": 1, "served_version": 3}
    (run / "evals.jsonl").write_text(json.dumps(summary) + "\n" + '{"label": "fin')  # a line being written
    with gzip.open(run / "evals" / "final-v3.text.jsonl.gz", "wt") as f:
        f.write(json.dumps(episode_record(_trajectory(chat), chat)) + "\n")
    return run


async def test_pages_of_a_running_run_and_the_token_off_loopback(tmp_path, chat):
    run = _run_dir(tmp_path, chat)
    async with TestClient(TestServer(make_app(run))) as client:
        index = await client.get("/")
        html = await index.text()
        assert index.status == 200 and "/eval/final-v3" in html
        assert '<div id="chart-heldout"><svg' in html and "no RL step yet" in html  # the report's chart, as SVG
        page = await client.get("/episode/eval/final-v3/0")
        html = await page.text()
        assert page.status == 200 and html.count('class="tok policy') == int(_trajectory(chat).is_action.sum())
        assert 'data-version="3"' in html and "data-adv" not in html
        assert (await client.get("/eval/final-v3?failure=fail_truncated")).status == 200
        assert (await client.get("/episode/eval/final-v3/1")).status == 404
    async with TestClient(TestServer(make_app(run, token="s3cret"))) as client:
        assert (await client.get("/")).status == 401
        assert (await client.get("/?token=wrong")).status == 401
        first = await client.get("/?token=s3cret")
        assert first.status == 200 and first.cookies[COOKIE].value == "s3cret"
        assert (await client.get("/eval/final-v3")).status == 200  # the cookie from here on


def test_a_folder_that_is_not_a_run_exits_2_naming_what_is_missing(tmp_path):
    proc = subprocess.run([sys.executable, "-P", "-m", "agentrl.cli", "view", str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "has no config.toml" in proc.stderr, proc.stderr
