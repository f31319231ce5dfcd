"""WeightPublisher: how often a push makes the servers drop their KV (kv_refresh_every); per-server push
isolation (a down server is marked down, the others get the weights, it is re-pushed when it answers);
the weights files a killed writer leaves behind are found by its PID and removed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from aiohttp import web

from agentrl.common import weights
from agentrl.common.transport import VersionPublisher
from agentrl.learner.publish import WeightPublisher

WRITER = """
import sys, time, torch
from agentrl.common import weights
weights.SHM_DIR = sys.argv[1]
print(weights.write_weights({"w": torch.zeros(100_000)}), flush=True)
if sys.argv[2] == "wait":
    time.sleep(600)
"""


def _writer(root: Path, mode: str) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-P", "-c", WRITER, str(root), mode], stdout=subprocess.PIPE, text=True)
    return proc, Path(proc.stdout.readline().strip())


def test_a_killed_writers_weights_are_removed_by_pid_and_a_live_ones_are_kept(tmp_path, monkeypatch):
    proc, path = _writer(tmp_path, "wait")
    try:
        own = tmp_path / f"agentrl-weights-{proc.pid}"
        assert path.parent == own and path.stat().st_size > 400_000
        assert list(tmp_path.iterdir()) == [own]  # nothing of the write outside its directory
        assert weights.sweep_weights_dirs(tmp_path) == [] and path.exists()  # its writer runs
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    # The next writer (here: this process) sweeps what the killed one left.
    monkeypatch.setattr(weights, "SHM_DIR", str(tmp_path))
    mine = weights.write_weights({"w": torch.zeros(10)})
    assert not own.exists() and list(tmp_path.iterdir()) == [mine.parent]
    assert weights.sweep_weights_dirs(tmp_path) == []  # this process runs: its directory stays


def test_the_sweep_leaves_another_users_directory_and_tolerates_a_concurrent_sweeper(tmp_path, monkeypatch):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    left = tmp_path / f"agentrl-weights-{int(gone.stdout)}"  # a process that no longer runs
    left.mkdir()
    if os.getuid() == 0:  # only root can hand the directory to another user
        os.chown(left, 4242, -1)
        assert weights.sweep_weights_dirs(tmp_path) == [] and left.exists()
        os.chown(left, 0, -1)

    def removed_meanwhile(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(weights.shutil, "rmtree", removed_meanwhile)
    assert weights.sweep_weights_dirs(tmp_path) == []  # no error: the other sweeper got it
    monkeypatch.undo()
    assert weights.sweep_weights_dirs(tmp_path) == [left] and not left.exists()


def test_a_writer_that_exits_normally_leaves_nothing(tmp_path):
    proc, path = _writer(tmp_path, "exit")
    assert proc.wait(timeout=60) == 0 and path.name.endswith(".safetensors")
    proc.stdout.close()
    assert list(tmp_path.iterdir()) == []


async def test_every_kth_push_recomputes_the_servers_kv(monkeypatch, tmp_path):
    calls: list[tuple[str, int, bool]] = []

    async def fake_push(url, path, version, *, timeout_s, recompute_kv, transport):
        calls.append((url, version, recompute_kv))
        return weights.PushResult(version, 0.0, 0.0, 0.0, 0.0)

    monkeypatch.setattr(weights, "push_weights", fake_push)
    monkeypatch.setattr(weights, "SHM_DIR", str(tmp_path))
    publisher = WeightPublisher(["http://a", "http://b"], kv_refresh_every=3)
    for version in range(1, 8):
        await publisher.publish(version, {"w": torch.zeros(2)})
    await publisher.wait()
    refreshed = sorted({v for _, v, recompute in calls if recompute})
    assert refreshed == [3, 6] and len(calls) == 14  # both servers, every push; the KV only on every 3rd
    every = WeightPublisher(["http://a"])
    await every.publish(1, {"w": torch.zeros(2)})
    await every.wait()
    assert calls[-1] == ("http://a", 1, True)  # the default recomputes on every push
    with pytest.raises(ValueError, match="kv_refresh_every"):
        WeightPublisher(["http://a"], kv_refresh_every=0)


# ---- per-server push isolation -------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class _ServerState:
    version: str = "default"
    staged: str | None = None
    pushes: list[str] = field(default_factory=list)
    busy_s: float = 0.0
    """How long a stage takes, during which /weight_info does not answer either (a busy server)."""
    busy: bool = False


@contextlib.asynccontextmanager
async def weight_server(port: int | None = None):
    """A real HTTP server speaking the endpoints a push uses (those of a vLLM server started with
    agentrl's worker extension: collective_rpc stage/apply, pause, update_weight_version, resume,
    weight_info). It checks that the staged file exists, as the worker does."""
    state = _ServerState()

    async def rpc(request: web.Request) -> web.Response:
        body = await request.json()
        if body["method"] == "agentrl_stage_weights":
            if not Path(body["args"][0]).is_file():
                return web.json_response({"results": [{"ok": False, "error": f"no file {body['args'][0]}"}]})
            state.staged = body["args"][0]
            state.busy = True
            await asyncio.sleep(state.busy_s)
            state.busy = False
            return web.json_response({"results": [{"ok": True, "stage_s": 0.0}]})
        return web.json_response({"results": [{"ok": True, "reload_s": 0.0}]})

    async def set_version(request: web.Request) -> web.Response:
        state.version = (await request.json())["new_version"]
        state.pushes.append(state.version)
        return web.json_response({})

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({})

    async def info(request: web.Request) -> web.Response:
        while state.busy:
            await asyncio.sleep(0.05)
        return web.json_response({"weight_version": state.version})

    app = web.Application()
    app.router.add_post("/collective_rpc", rpc)
    app.router.add_post("/update_weight_version", set_version)
    app.router.add_post("/pause", ok)
    app.router.add_post("/resume", ok)
    app.router.add_get("/weight_info", info)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = port or _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        await runner.cleanup()


async def _until(pred, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


async def test_a_down_server_does_not_stop_the_others_and_gets_the_latest_weights_when_it_answers(monkeypatch, tmp_path):
    monkeypatch.setattr(weights, "SHM_DIR", str(tmp_path))
    dead_port = _free_port()  # nothing listens here yet
    dead_url = f"http://127.0.0.1:{dead_port}"
    async with weight_server() as (up_url, up):
        publisher = WeightPublisher([up_url, dead_url], probe_timeout_s=2.0, probe_interval_s=0.2)
        await publisher.probe()  # at start: the dead server is marked down, not fatal
        assert publisher.versions == {up_url: 0} and set(publisher.down) == {dead_url}
        for version in (1, 2):
            await publisher.publish(version, {"w": torch.full((2,), float(version))})
            report = await publisher.wait()
            assert set(report.per_server) == {up_url} and set(report.failed) == {dead_url}
            assert up.version == str(version) and publisher.served_version == version
        assert publisher.num_push_failures[dead_url] >= 1 and publisher.num_push_failures[up_url] == 0
        [kept] = tmp_path.glob("agentrl-weights-*/*")  # only the latest weights wait for the down server
        async with weight_server(dead_port) as (_, revived):
            await _until(lambda: dead_url not in publisher.down)
            assert revived.pushes == ["2"] and publisher.num_recoveries == 1
            assert publisher.versions == {up_url: 2, dead_url: 2} and publisher.served_version == 2
            await publisher.publish(3, {"w": torch.zeros(2)})
            report = await publisher.wait()
            assert set(report.per_server) == {up_url, dead_url} and not report.failed
            assert up.pushes == ["1", "2", "3"] and revived.pushes == ["2", "3"]
            assert not kept.exists() and len(list(tmp_path.glob("agentrl-weights-*/*"))) == 1  # the latest only
        # It goes away again mid-run: the push to it fails, the other still takes version 4.
        await publisher.publish(4, {"w": torch.zeros(2)})
        report = await publisher.wait()
        assert set(report.per_server) == {up_url} and dead_url in publisher.down and up.version == "4"
        assert publisher.versions == {up_url: 4} and publisher.served_version == 4
        await publisher.close()
        assert not list(tmp_path.glob("agentrl-weights-*/*"))


async def _watched_after_one_push(url: str, version: int) -> WeightPublisher:
    """A publisher whose watch runs every 0.2 s (queries time out after 0.3 s), after one push of `version`."""
    publisher = WeightPublisher([url], probe_timeout_s=0.3, probe_interval_s=0.2)
    await publisher.probe()
    await publisher.publish(version, {"w": torch.full((2,), float(version))})
    await publisher.wait()
    return publisher


async def test_a_server_restarted_between_two_pushes_is_pushed_the_latest_weights(monkeypatch, tmp_path):
    """A server that dies and is started again between two pushes never fails a push, but serves the
    base weights (version 0) while the publisher thinks it serves the last: the publisher's watch asks
    the servers that are up too, and pushes the latest weights to one that went back."""
    monkeypatch.setattr(weights, "SHM_DIR", str(tmp_path))
    async with weight_server() as (url, server):
        publisher = await _watched_after_one_push(url, 5)
        assert server.pushes == ["5"]
        await asyncio.sleep(0.6)  # watched and found serving what it was pushed: no push
        assert server.pushes == ["5"]
        server.version = "default"  # started again: a fresh server's label, the base weights
        await _until(lambda: server.pushes == ["5", "5"])
        await _until(lambda: url not in publisher.down and publisher.versions == {url: 5})
        assert server.version == "5" and publisher.num_recoveries == 1 and publisher.served_version == 5
        # A push that keeps the server busy longer than a version query may take: it is pushed once,
        # stays up, and only the latest push's file is kept. (This does not pin the race the watch's
        # idle check prevents, a recovery beside a push in flight: that needs a server answering at
        # the right moment; see WeightPublisher.wait.)
        server.busy_s = 1.0
        await publisher.publish(6, {"w": torch.full((2,), 6.0)})
        await publisher.wait()
        await asyncio.sleep(0.6)
        assert server.pushes == ["5", "5", "6"] and not publisher.down
        assert len(list(tmp_path.glob("agentrl-weights-*/*"))) == 1  # the latest push's file only
        await publisher.close()
        assert not list(tmp_path.glob("agentrl-weights-*/*"))


async def test_a_server_that_moved_is_followed_through_the_directory_and_pushed_the_latest_weights(monkeypatch, tmp_path):
    """A server started again on another node answers at another URL: the publisher reads the run's
    service directory before its recovery round, drops the old URL and pushes the new one the latest
    weights once it answers; a directory that is not one is logged and changes nothing."""
    from agentrl.common.directory import INFERENCE, DirectoryFollower, write_directory

    monkeypatch.setattr(weights, "SHM_DIR", str(tmp_path))
    old_url = f"http://127.0.0.1:{_free_port()}"  # the server's node is gone: nothing answers here
    path = tmp_path / "services.json"
    write_directory(path, {INFERENCE: [old_url]})
    publisher = WeightPublisher([old_url], probe_timeout_s=0.5, probe_interval_s=0.2,
                                directory=DirectoryFollower(path, {INFERENCE: [old_url]}))
    await publisher.probe()
    await publisher.publish(3, {"w": torch.full((2,), 3.0)})
    assert not (await publisher.wait()).per_server and set(publisher.down) == {old_url}
    path.write_text("{not json")
    await asyncio.sleep(0.5)
    assert publisher.server_urls == [old_url]
    async with weight_server() as (new_url, moved):
        write_directory(path, {INFERENCE: [new_url], "tools/search": ["tcp://127.0.0.1:1"]})
        await _until(lambda: moved.pushes == ["3"])
        await _until(lambda: publisher.versions == {new_url: 3})
        assert publisher.server_urls == [new_url] and not publisher.down and publisher.served_version == 3
        await publisher.publish(4, {"w": torch.full((2,), 4.0)})
        report = await publisher.wait()
        assert set(report.per_server) == {new_url} and moved.pushes == ["3", "4"]
    await publisher.close()


async def test_a_busy_server_that_answers_a_version_query_late_is_not_pushed_again(monkeypatch, tmp_path):
    """The watch asks the servers that are up for their versions every round. One that is busy (on a
    CPU: an evaluation beside the actor) and answers late has not restarted: it stays up and is not
    pushed the same weights again (seen in a main job: a push of the same version every ~10 s, each
    dropping the KV cache, which starved training and made an evaluation take 10 minutes)."""
    monkeypatch.setattr(weights, "SHM_DIR", str(tmp_path))
    async with weight_server() as (url, server):
        publisher = await _watched_after_one_push(url, 5)
        server.busy = True  # its /weight_info does not answer within the probe timeout
        await asyncio.sleep(1.5)
        assert not publisher.down and publisher.versions == {url: 5}
        server.busy = False
        await asyncio.sleep(0.6)
        assert server.pushes == ["5"] and not publisher.down and publisher.num_recoveries == 0
        # Marked down by a failed query elsewhere (a push's own), but still serving the latest: taken
        # back without a push.
        publisher._mark_down(url, "test: a query that timed out")
        await _until(lambda: not publisher.down)
        assert server.pushes == ["5"] and publisher.versions == {url: 5}
        await publisher.close()


async def test_the_learner_starts_with_a_server_down_and_serves_its_version_to_the_rest(monkeypatch, tmp_path):
    """After a restart the learner asks every server what it serves; one that does not answer no
    longer stops it: the others get this lineage's weights, the down one gets them when it answers."""
    from support.synthetic import tiny_llama

    from agentrl.learner.config import LearnerConfig
    from agentrl.learner.service import Learner
    from agentrl.learner.trainer_config import TrainerConfig

    monkeypatch.setattr(weights, "SHM_DIR", str(tmp_path))
    model_dir = tmp_path / "model"
    tiny_llama(128, seed=0).save_pretrained(model_dir)
    dead_url = f"http://127.0.0.1:{_free_port()}"
    async with weight_server() as (up_url, up):
        up.version = "7"  # weights this lineage does not own (pushed after its checkpoint)
        config = LearnerConfig(output_dir=str(tmp_path / "run"), model_dir=str(model_dir), server_urls=[up_url, dead_url],
                               transport={"version_endpoint": None}, tensorboard=False, progress_bar=False,
                               trainer=TrainerConfig(precision="fp32"))
        learner = Learner(config)
        learner.start_training()
        learner.publisher = WeightPublisher(config.server_urls, probe_timeout_s=2.0, probe_interval_s=60.0)
        served = await learner._start_publishing()
        assert served == 0 and up.pushes == ["0"] and set(learner.publisher.down) == {dead_url}
        await learner.publisher.close()


async def test_a_server_that_catches_up_between_two_steps_is_announced_to_the_actor(monkeypatch, tmp_path):
    """The run's only server is lost while the learner trains ahead of it; the actor, held back by
    its staleness bound, sends no groups, so no step comes. When the server answers again and takes
    the latest weights, the learner announces the new served version at once (seen in CI before the
    fix: the actor waited with the learner 5 versions ahead of the announced one until its budget
    ran out, though the server had served version 5 for minutes)."""
    from support.synthetic import tiny_llama

    from agentrl.common.transport import VersionSubscriber
    from agentrl.learner.config import LearnerConfig
    from agentrl.learner.service import Learner
    from agentrl.learner.trainer_config import TrainerConfig

    monkeypatch.setattr(weights, "SHM_DIR", str(tmp_path))
    model_dir = tmp_path / "model"
    tiny_llama(128, seed=0).save_pretrained(model_dir)
    port = _free_port()  # the server's node is gone: nothing answers here yet
    url, versions_ep = f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{_free_port()}"
    config = LearnerConfig(output_dir=str(tmp_path / "run"), model_dir=str(model_dir), server_urls=[url],
                           transport={"version_endpoint": versions_ep}, tensorboard=False, progress_bar=False,
                           trainer=TrainerConfig(precision="fp32"))
    learner = Learner(config)
    learner.start_training()
    learner.publisher = WeightPublisher(config.server_urls, probe_timeout_s=0.5, probe_interval_s=0.2)
    learner.version_pub = VersionPublisher(versions_ep, republish_interval_s=0.1)
    await learner._start_announcing(await learner._start_publishing())
    actor = VersionSubscriber(versions_ep)
    await actor.start()
    try:
        assert await actor.wait_until(lambda v: True, timeout_s=10) == (0, 0)
        learner.step = 5  # trained ahead while the server was lost; its push failed
        await learner.publisher.publish(5, {"w": torch.full((2,), 5.0)})
        assert not (await learner.publisher.wait()).per_server
        await learner.version_pub.publish(5, learner.publisher.served_version)
        assert await actor.wait_until(lambda v: v[0] == 5, timeout_s=10) == (5, 0)
        async with weight_server(port) as (_, server):  # it answers again: the watch pushes it version 5
            assert await actor.wait_until(lambda v: v[1] == 5, timeout_s=20) == (5, 5)
            assert server.pushes == ["5"]
    finally:
        await actor.close()
        await learner.version_pub.close()
        await learner.publisher.close()


@pytest.mark.slow
async def test_the_real_vllm_server_takes_the_push_while_another_server_is_unreachable(vllm_server, model_dir):
    """The same isolation against the session's real vLLM server: it takes the push (its own weights,
    relabelled, then the label put back) while the second server has nothing listening."""
    from safetensors.torch import load_file

    from agentrl.common.inference import VLLMClient

    original = load_file(str(model_dir / "model.safetensors"))
    real = vllm_server.base_url
    dead_url = f"http://127.0.0.1:{_free_port()}"
    async with VLLMClient(real) as client:
        version0 = await client.weight_version()
    publisher = WeightPublisher([real, dead_url], probe_timeout_s=2.0, probe_interval_s=3600.0)
    try:
        await publisher.probe()
        assert publisher.versions == {real: version0} and set(publisher.down) == {dead_url}
        await publisher.publish(version0 + 1, original)
        report = await publisher.wait()
        assert set(report.per_server) == {real} and set(report.failed) == {dead_url}
        async with VLLMClient(real) as client:
            assert await client.weight_version() == version0 + 1
        assert publisher.served_version == version0 + 1
    finally:
        await publisher.publish(version0, original)  # the label back, for the tests after this one
        await publisher.wait()
        await publisher.close()
    async with VLLMClient(real) as client:
        assert await client.weight_version() == version0
