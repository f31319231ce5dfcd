"""`agentrl train` with `[network] host` = this machine's routable address (not loopback): the run
provisions the learners' CurveZMQ keys and the vLLM server's control token under the run directory
(0600), binds the learners and the server there, and trains through them, the weights reaching the
server by the `stream` transport (its URL is not loopback); the token is on no command line and in
no log; a client without the keys gets nothing through to the learner. The learner runs as two
torchrun ranks (`cluster.learner.ranks = 2`), and RL ends at its `max_steps`, before the budget."""

from __future__ import annotations

import asyncio
import json
import stat
import subprocess
import time
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.run]

# Over tests/tiny_run.toml (with network.host): the cold start, then RL until step 4 (SFT's steps
# count), before the budget; the learner as two torchrun ranks, rank 0 binding the learner's sockets
# and pushing. The budget is an upper bound: 4 minutes once ran out before the fourth step's exit on
# CI (slower kind, beside the rest of the suite).
SETS = ("sft.enabled=true", "learner.max_steps=4", "eval.baseline_questions=0", "cluster.learner.ranks=2",
        "minutes=8")



def test_a_run_off_loopback_provisions_its_credentials_and_trains_through_them(tmp_path):
    from support.network import routable_address
    from support.runs import train_argv
    from support.synthetic import make_group

    host = routable_address()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address to bind")
    out = tmp_path / "run"
    proc = subprocess.Popen(train_argv(f'network.host="{host}"', *SETS, out=out),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # While the RL learner runs: a client without the keys sends a well-formed group; no answer comes.
        deadline = time.monotonic() + 600
        while not (out / "learner-rl.toml").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        assert (out / "learner-rl.toml").exists(), "the RL phase did not start"
        learner = tomllib.loads((out / "learner-rl.toml").read_text())
        assert urlparse(learner["transport"]["group_endpoint"]).hostname == host
        answered = asyncio.run(_send_without_keys(learner["transport"]["group_endpoint"], make_group("intruder", [1.0, 0.0])))
        assert answered is False, "the learner answered a client without the run's keys"
        # The token is on no command line of any process (the run's included) while they run, and
        # only the server, the learners and their own children have it in their environment.
        token = (out / "control_token").read_text().strip()
        holders = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    cmdline, environ = (entry / "cmdline").read_bytes(), (entry / "environ").read_bytes()
                except (FileNotFoundError, ProcessLookupError, PermissionError):
                    continue
                assert token.encode() not in cmdline, cmdline
                if token.encode() in environ:
                    holders.append(int(entry.name))
        assert holders
        strays = [(pid, _argv(pid)) for pid in holders if _entitled_ancestor(pid) is None]
        assert not strays, f"processes outside the server and the learners hold the token: {strays}"
        stdout, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout[-3000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["rl_steps"] + summary["sft_steps_done"] == 4 and "learner finished its max_steps" in stdout
    learner_log = (out / "logs" / "learner-rl.log").read_text()
    assert "ranks=2" in learner_log and "learner rank 1: stopped at rank 0's request" in learner_log, learner_log[-2000:]

    # The credentials: made by the run, 0600, in a 0700 folder.
    token_file = out / "control_token"
    for path in (token_file, out / "curve" / "agentrl-run-learner.key_secret", out / "curve" / "agentrl-run.key_secret",
                 out / "curve" / "agentrl-run-tools.key_secret"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE((out / "curve").stat().st_mode) == 0o700
    assert learner["transport"]["curve_secret_key_file"] == str(out / "curve" / "agentrl-run-learner.key_secret")
    # The server bound the routable address and the pushes streamed to it.
    actor = tomllib.loads((out / "actor.toml").read_text())
    assert all(urlparse(url).hostname == host for url in actor["vllm"])
    # So did the tool services, with the run's certificates.
    assert actor["remote_tools"] and all(urlparse(e).hostname == host for s in actor["remote_tools"] for e in s["endpoints"])
    assert all(s["curve_server_key"] == str(out / "curve" / "agentrl-run-tools.key") for s in actor["remote_tools"])
    pushes = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    transports = {t for p in pushes for t in p.get("publish/last_transports", [])}
    assert transports == {"stream"}, transports
    # The token is on no command line and in no log or config the run wrote.
    token = token_file.read_text().strip()
    texts = [stdout, *(p.read_text(errors="replace") for p in out.rglob("*") if p.is_file() and p.suffix in (".log", ".toml", ".json", ".jsonl", ".md"))]
    assert not any(token in text for text in texts)


def _argv(pid: int) -> list[bytes]:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []


def _parent(pid: int) -> int:
    try:
        stat_text = (Path("/proc") / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    return int(stat_text.rsplit(")", 1)[1].split()[1])


def _entitled_ancestor(pid: int) -> int | None:
    """The vLLM server or learner process that ``pid`` is or descends from (vLLM's engine core and
    workers are its children and inherit its environment), or None."""
    while pid > 1:
        argv = _argv(pid)
        if b"vllm.entrypoints.openai.api_server" in argv or (b"agentrl.cli" in argv and b"learner" in argv):
            return pid
        pid = _parent(pid)
    return None


async def _send_without_keys(endpoint: str, group) -> bool:
    """Whether the learner answers (acks or nacks) a group from a GroupSender without keys within 10 s."""
    from agentrl.common.transport import GroupSender

    sender = GroupSender(endpoint)
    await sender.start()
    send = asyncio.ensure_future(sender.send(group))  # may block for good: libzmq drops a refused peer's pipe
    try:
        await asyncio.sleep(10)
        return sender.num_acked + sender.num_rejected + sender.num_unmatched_nacks > 0
    finally:
        send.cancel()
        await sender.close()
