"""The Ray launcher on a real Ray cluster of simulated nodes (`ray.cluster_utils.Cluster`: one raylet
per node on this machine, a head with no CPUs so that nothing runs there by accident). Every host
actor runs in a mount namespace of its own, with an empty /tmp and /dev/shm, as on separate hosts
(agentrl/launch/simulated.py); each case checks that of the roles it starts.

1. Placement: tool services go to the node that advertises the tool resource, bind that node's
   address and answer calls; one whose process crashes on a live node is started again there at its
   endpoint; a host actor killed takes its role's process with it (its watchdog) and reads as lost;
   a role no node can take stops with the resources it asked for.
2. A whole `agentrl train --launcher ray` run over seven nodes, every loss in turn: the learner's
   node (the learner moves to a spare, from its checkpoint), the server's node and a tools node (each
   service moves to the other node of its kind), the driver (SIGKILL: no process of the run left
   30 s later); `--resume` trains on, and with its last inference node removed the run stops saying
   so. Every group is trained exactly once.
3. Learner ranks (`cluster.learner.ranks`): one placement group, torchrun on each bundle's node with
   a static rendezvous at bundle 0's; a rank's node lost, a new gang resumes from the checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster
from support.runs import train_argv

from agentrl.common.config import build
from agentrl.common.proctable import all_processes, descendants, read_proc, same_process
from agentrl.credentials import RunCredentials
from agentrl.engine.roles import HOST_LOST, CommandRole, agentrl_argv
from agentrl.engine.services import Services, ServicesConfig, ToolCurve, tool_client_keys
from agentrl.launch.keeper import ServiceKeeper
from agentrl.launch.plan import ClusterConfig
from agentrl.launch.ray_launcher import RayLauncher, RayPlacementError
from agentrl.launch.simulated import mount_namespace, private_mounts_env
from agentrl.learner.checkpoint import checkpoint_dirs, checkpoint_step, load_latest_checkpoint
from agentrl.toolservers.client import ToolClient


def _cluster(nodes: dict[str, dict]) -> tuple[Cluster, dict]:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    added = {name: cluster.add_node(num_cpus=2, resources=resources) for name, resources in nodes.items()}
    cluster.wait_for_nodes()
    return cluster, added


def _private_mounts(monkeypatch, shared: Path) -> None:
    """Every host actor of this process's Ray driver, and of the drivers it starts (they inherit the
    environment), runs in a mount namespace of its own with an empty /tmp and /dev/shm: only
    `shared` (the run's directory) and sockets connect the simulated nodes."""
    for name, value in private_mounts_env([shared]).items():
        monkeypatch.setenv(name, value)


def _private(pids: list[int]) -> None:
    """Each of `pids` (roles' processes on different hosts) sees mounts of its own."""
    spaces = [mount_namespace(pid) for pid in pids]
    assert mount_namespace(os.getpid()) not in spaces and len(set(spaces)) == len(spaces), spaces


def _gone_within(pids: list[int], timeout_s: float) -> list:
    infos = [info for pid in pids if (info := read_proc(pid)) is not None]
    deadline = time.monotonic() + timeout_s
    while (left := [i for i in infos if same_process(i)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.slow
def test_tool_services_go_where_the_tool_resource_is_and_die_with_their_host(tmp_path, monkeypatch):
    cluster, nodes = _cluster({"tools": {"agentrl_tools": 2}, "other": {}})
    _private_mounts(monkeypatch, tmp_path)
    ray.init(address=cluster.address, log_to_driver=False, include_dashboard=False)
    try:
        config = build(ClusterConfig, {"launcher": "ray", "tools": {"resource": "agentrl_tools"}, "place_timeout_s": 5})
        launcher = RayLauncher(config, tmp_path)
        # Off loopback the services admit only the run's client certificate (as `agentrl train` provisions).
        curve = ToolCurve(launcher.host, RunCredentials(tmp_path, host=launcher.host, learner_transport=None,
                                                        external_vllm=False).tools())
        slots = [launcher.place(f"tool-calculator-{r}", "tools") for r in range(2)]
        assert {s.node_id for s in slots} == {nodes["tools"].node_id}
        for slot in slots:
            slot.start(CommandRole(slot.name, agentrl_argv("toolserver", "calculator", "--bind", "tcp://{host}:*",
                                                           *curve.server_options()),
                                   str(tmp_path / "logs" / f"{slot.name}.log"), ready_prefix="READY "))
            assert slot.endpoint.startswith(f"tcp://{slot.host}:"), slot.endpoint  # bound there, port chosen there

        async def call() -> str:
            async with ToolClient([s.endpoint for s in slots], **tool_client_keys(curve.remote("calculator", []))) as client:
                return str((await client.call("calculator", {"expression": "6*7"})).content)

        assert "42" in asyncio.run(call())
        _private([s.pid for s in slots])

        # The service's process crashes on a live node: it is started again there, at its endpoint.
        crashed, endpoint, pid = slots[1], slots[1].endpoint, slots[1].pid
        crashed.signal(signal.SIGKILL)
        deadline = time.monotonic() + 15
        while crashed.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert crashed.poll() == -signal.SIGKILL
        keeper = ServiceKeeper(Services(vllm_urls=[]), launcher, ServicesConfig(), tmp_path, tmp_path / "services.json", print)
        again = asyncio.run(keeper.start_again(crashed, crashed.poll(), "tools"))
        assert again is crashed and (again.endpoint, again.node_id) == (endpoint, nodes["tools"].node_id) and again.pid != pid
        assert keeper.restarts["tools"] == 1 and "42" in asyncio.run(call())

        # The host actor killed: the watchdog it started stops the service; the slot reads as lost.
        victim = slots[0]
        ray.kill(victim.actor)
        assert not _gone_within([victim.pid], 15), "the tool service outlived its host actor"
        assert victim.poll() == HOST_LOST
        assert slots[1].poll() is None

        with pytest.raises(RayPlacementError, match=r"asks for .*'nowhere'"):
            RayLauncher(build(ClusterConfig, {"learner": {"resource": "nowhere"}, "place_timeout_s": 3}),
                        tmp_path).place("learner-rl", "learner")
        launcher.close()
        assert not _gone_within([slots[1].pid], 15)
    finally:
        ray.shutdown()
        cluster.shutdown()


# Over tests/tiny_run.toml: two search replicas, every role placed by Ray on the node its resource
# names. The budget is an upper bound: each run case ends the run itself (a killed driver, the last
# inference node removed) once it has what it checks, and the slower machine kind needs the room.
SETS = ("minutes=10.0", "services.search_replicas=2", 'cluster.launcher="ray"', 'cluster.tools.resource="agentrl_tools"',
        'cluster.inference.resource="agentrl_inference"', "cluster.inference.cpus=2",
        'cluster.learner.resource="agentrl_learner"', "cluster.learner.cpus=2", 'cluster.actor.resource="agentrl_actor"')



def _weight_version(url: str) -> str:
    import urllib.request

    # A server answers once the push it is taking (paused meanwhile) has landed.
    with urllib.request.urlopen(url + "/weight_info", timeout=120) as answer:
        return json.loads(answer.read())["weight_version"]


def _metric_lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _wait_line(lines: list[str], text: str, proc: subprocess.Popen, timeout_s: float, start: int = 0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in lines[start:]:
            if text in line:
                return line
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"no line with {text!r} within {timeout_s} s (rc {proc.poll()}):\n" + "\n".join(lines[-40:]))


@pytest.mark.run
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_run_on_a_ray_cluster_survives_lost_hosts_and_nodes_and_a_killed_driver_and_stops_with_no_inference_left(
        tmp_path, monkeypatch):
    """One run over seven nodes (two inference, a learner and a spare, two tools, the actor), every
    loss in turn, each checked before the next (a host actor killed alone, whose watchdog stops its
    role, is the placement case's):
    - the learner's node removed: the learner starts again on the spare from its checkpoint (one
      restart), at ports of that node, and the actor follows it through the service directory;
    - the server's node and a tools node removed: the server starts again on the other inference node
      at an endpoint of that node, the search replica of the lost node on the other tools node, the
      directory says so, the actor's pool, its tool client and the learner follow (the learner pushes
      the latest weights), and training goes on;
    - the driver SIGKILLed: Ray ends its host actors, whose watchdogs stop every process of the run
      within 30 s;
    - `--resume` places the run again and trains on; then the last inference node is removed, and the
      run stops saying which server, where, and how to continue, rather than fail every episode
      until its budget ends. Every group is trained exactly once across all of it."""
    import threading

    cluster, nodes = _cluster({"inference": {"agentrl_inference": 1}, "inference2": {"agentrl_inference": 1},
                               "learner": {"agentrl_learner": 1}, "spare": {"agentrl_learner": 1},
                               "tools": {"agentrl_tools": 2}, "tools2": {"agentrl_tools": 2}, "actor": {"agentrl_actor": 1}})
    kind_of_node = {node.node_id[:12]: {"inference2": "inference", "spare": "learner", "tools2": "tools"}.get(name, name)
                    for name, node in nodes.items()}
    name_of_node = {node.node_id[:12]: name for name, node in nodes.items()}
    out = tmp_path / "run"
    metrics = out / "rl" / "metrics.jsonl"
    _private_mounts(monkeypatch, tmp_path)

    def node_in(line: str) -> str:
        return line.split(" on node ")[1].split()[0]

    def pid_in(line: str) -> int:
        return int(line.split("(pid ")[1].split(")")[0].split(",")[0])

    def a_step_after(trained: int, lines: list[str], why: str) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and len(_metric_lines(metrics)) <= trained:
            time.sleep(1.0)
        assert len(_metric_lines(metrics)) > trained, f"no RL step after {why}:\n" + "\n".join(lines[-30:])

    try:
        proc = subprocess.Popen(train_argv(*SETS, "cluster.place_timeout_s=30", out=out, extra=("--ray-address", cluster.address)),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in proc.stdout), daemon=True).start()
        try:
            _wait_line(lines, "started actor", proc, 900)
            for line in lines:  # every role on a node of the kind its resource names
                if " on node " in line:
                    kind = ("tools" if "tool service" in line else "inference" if "vLLM" in line else
                            "actor" if "started actor" in line else "learner")
                    assert kind_of_node[node_in(line)] == kind, line
            a_step_after(0, lines, "the start")

            served = next(line for line in lines if line.startswith("vLLM server:"))
            url = served.split()[2]

            # 1. The learner's node lost: the learner starts again on the other learner node, from its checkpoint.
            learner_node = node_in(next(line for line in lines if line.startswith("started learner-rl")))
            trained = len(_metric_lines(metrics))
            mark = len(lines)
            cluster.remove_node(nodes[name_of_node[learner_node]])
            moved = _wait_line(lines, "placed again on node", proc, 120, start=mark)
            assert any("restarting it (restart 1)" in line for line in lines[mark:]), "\n".join(lines[mark:])
            restarted = _wait_line(lines, "started learner-rl", proc, 120, start=mark)
            assert node_in(restarted) != learner_node and kind_of_node[node_in(restarted)] == "learner", moved
            a_step_after(trained, lines, "the learner started again")
            group_endpoint, version_endpoint = json.loads((out / "services.json").read_text())["learner"]
            actor_log = (out / "logs" / "actor.log").read_text()
            assert f"answers at {group_endpoint} now" in actor_log and f"answers at {version_endpoint} now" in actor_log, \
                actor_log[-3000:]

            # 2. The server's node and a tools node lost: each service starts again on the other node of its kind.
            server_node = node_in(served)
            other = next(node for node, kind in kind_of_node.items() if kind == "inference" and node != server_node)
            server_tree = [pid_in(served), *descendants({pid_in(served)}, all_processes())]
            replicas = {line.split()[2] + line.split()[3]: line.split()[4] for line in lines
                        if line.startswith("tool service search #") and f"on node {nodes['tools'].node_id[:12]}" in line}
            assert replicas, "no search replica on the tools node:\n" + "\n".join(lines)  # SPREAD: one on each
            trained = len(_metric_lines(metrics))
            mark = len(lines)
            cluster.remove_node(nodes[name_of_node[server_node]])
            cluster.remove_node(nodes["tools"])
            _wait_line(lines, f"the vLLM server on node {server_node}", proc, 60, start=mark)
            # "vLLM server: URL on node ID (ADDRESS) again (pid N)"
            again = _wait_line(lines, f"on node {other} (", proc, 300, start=mark)
            assert again.startswith("vLLM server: ") and " again (pid " in again, again
            new_url = again.split()[2]
            assert new_url != url, again
            moved_replicas = {}
            for name, endpoint in replicas.items():  # "search#1:" -> tool-search-1
                slot = "tool-search-" + name.removeprefix("search#").rstrip(":")
                line = _wait_line(lines, f"tool service {slot}: ", proc, 120, start=mark)
                assert f"on node {nodes['tools2'].node_id[:12]} (" in line and " again (pid " in line, line
                moved_replicas[endpoint] = line.split()[3]
            directory = json.loads((out / "services.json").read_text())
            assert directory["inference"] == [new_url] and set(moved_replicas.values()) <= set(directory["tools/search"])
            assert not set(moved_replicas) & set(directory["tools/search"])
            assert not _gone_within(server_tree, 30), "the lost node's server outlived it"
            a_step_after(trained, lines, "the server started again")
            deadline = time.monotonic() + 120  # it takes the learner's weights (pushed in the background)
            while (served_version := _weight_version(new_url)) in ("default", "0") and time.monotonic() < deadline:
                time.sleep(1.0)
            assert served_version not in ("default", "0"), served_version
            actor_log = (out / "logs" / "actor.log").read_text()
            assert f"inference server {url} answers at {new_url} now" in actor_log, actor_log[-3000:]
            for old_endpoint, endpoint in moved_replicas.items():
                assert f"replica {old_endpoint} now answers at {endpoint}" in actor_log, actor_log[-3000:]
            learner_log = (out / "logs" / "learner-rl.log").read_text()
            assert f"server {url} answers at {new_url} now" in learner_log, learner_log[-3000:]

            # 3. SIGKILL the driver: Ray ends its host actors, whose watchdogs stop every process of the run.
            table = all_processes()
            role_pids = {pid_in(line) for line in lines if "(pid " in line}
            run_pids = [*descendants(role_pids, table), *(pid for pid in role_pids if pid in table)]
            alive_roles = [pid for pid in role_pids if pid in table]
            assert len(alive_roles) >= 5, (role_pids, "\n".join(lines))  # vLLM, 2 search, learner, actor
            _private(alive_roles)  # nothing of one role reaches another by a path in /tmp or /dev/shm
            proc.kill()
            left = _gone_within(run_pids, 30)
            assert not left, f"30 s after SIGKILL of the driver, still alive: {left}"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

        # 4. `--resume` trains on (RL would end 3 steps after its checkpoint); after its first step the
        # last inference node is removed, and the run stops saying so. The budget is an upper bound: 4
        # minutes once ended the resumed RL phase before its first step (slower kind, beside the rest
        # of the suite).
        resume_step = checkpoint_step(checkpoint_dirs(out / "rl" / "checkpoints")[-1])
        trained = len(_metric_lines(metrics))
        proc = subprocess.Popen([sys.executable, "-P", "-m", "agentrl.cli", "train", "--resume", str(out), "--set", "minutes=8.0",
                                 "--set", f"learner.max_steps={resume_step + 3}", "--ray-address", cluster.address],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        lines = []
        threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in proc.stdout), daemon=True).start()
        try:
            served = _wait_line(lines, "vLLM server: ", proc, 600)
            assert node_in(served) == other, served
            a_step_after(trained, lines, "the resume")
            server_tree = [pid_in(served), *descendants({pid_in(served)}, all_processes())]
            mark = len(lines)
            cluster.remove_node(nodes[name_of_node[other]])
            assert proc.wait(timeout=180) != 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        time.sleep(1.0)  # the reader thread drains the pipe
        text = "\n".join(lines[mark:])  # since the node's removal
        assert f"the vLLM server on node {other}" in text, text[-3000:]
        assert f"agentrl train --resume {out}" in text and "could not be started again" in text, text[-3000:]
        assert not _gone_within(server_tree, 30), "the lost node's server outlived it"

        # Exactly once: the last record of each step up to the last checkpoint lists each group once,
        # and those are the ledger's; the resume trained at least one step beyond its checkpoint.
        state = load_latest_checkpoint(out / "rl" / "checkpoints")
        final_step = int(state["step"])
        assert final_step > resume_step
        last_record_of_step = {r["step"]: r for r in _metric_lines(metrics)}
        seen = [g for step, r in sorted(last_record_of_step.items()) if step <= final_step for g in r.get("group_ids", [])]
        assert seen and len(seen) == len(set(seen)), "a group was trained at two steps"
        assert set(seen) == set(state["ledger"]["trained"])
    finally:
        cluster.shutdown()


def _learner_toml(path: Path, run_dir: Path, model_dir: Path, transport: dict) -> None:
    from agentrl.common.config import dump_toml

    # One group = 2 samples x 25 tokens; 100 tokens a step: 2 groups, each rank 2 of the 4 sequences.
    path.write_text(dump_toml({
        "output_dir": str(run_dir), "model_dir": str(model_dir), "tokens_per_step": 100, "checkpoint": {"every": 1},
        "publish": {"every": 0}, "staleness_bound": 100, "transport": transport, "dist_timeout_s": 30.0,
        "tensorboard": False, "progress_bar": False,
        "trainer": {"precision": "fp32", "max_row_tokens": 256, "train_layers": 1, "train_embeddings": False}}))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_learner_ranks_are_one_placement_group_and_a_lost_rank_node_starts_the_gang_again(tmp_path, monkeypatch):
    """`cluster.learner.ranks = 2`, STRICT_SPREAD: one placement group, a bundle on each of two learner
    nodes, torchrun on each with a static rendezvous at bundle 0's node, whose rank binds the learner's
    socket there; both ranks train the groups sent to it. Then rank 1's node is removed: the gang reads
    as lost, what is left of it is stopped and its group released (`ServiceKeeper.replace_slot`), and a
    new gang on the surviving node and the spare resumes from the 2-rank checkpoint; every group is
    trained once."""
    from support.synthetic import make_group, tiny_llama

    from agentrl.common.curve import load_client_keys
    from agentrl.common.transport import GroupSender
    from agentrl.launch.ray_launcher import RayGang
    from agentrl.learner.config import LearnerConfig
    from agentrl.learner.metrics import read_metrics

    cluster, nodes = _cluster({name: {"agentrl_learner": 1} for name in ("learner0", "learner1", "spare")})
    _private_mounts(monkeypatch, tmp_path)
    ray.init(address=cluster.address, log_to_driver=False, include_dashboard=False)
    model_dir, run_dir, logs = tmp_path / "model", tmp_path / "rl", tmp_path / "logs"
    tiny_llama(vocab_size=64).save_pretrained(model_dir)
    groups = [make_group(f"grp-{i:03d}", [1.0, 0.0], prompt_len=5, turns=[(8, 4), (8, 0)], vocab_size=64, seed=i)
              for i in range(6)]
    try:
        config = build(ClusterConfig, {"launcher": "ray", "place_timeout_s": 30,
                                       "learner": {"resource": "agentrl_learner", "ranks": 2, "strategy": "STRICT_SPREAD"}})
        launcher = RayLauncher(config, tmp_path)
        server_keys, client_keys = RunCredentials(tmp_path, host=launcher.host, learner_transport=LearnerConfig().transport,
                                                  external_vllm=False).learner()
        keeper = ServiceKeeper(None, launcher, None, tmp_path, tmp_path / "services.json", print)

        def start(gang: RayGang, label: str) -> str:
            endpoint = gang.free_endpoint()
            toml = tmp_path / f"learner-{label}.toml"
            _learner_toml(toml, run_dir, model_dir, {**server_keys, "group_endpoint": endpoint,
                                                     "version_endpoint": gang.free_endpoint()})
            gang.start(CommandRole("learner-rl", agentrl_argv("learner", "--config", str(toml)), str(logs / f"learner-{label}.log"),
                                   env={"OMP_NUM_THREADS": "1"}))
            return endpoint

        async def send(endpoint: str, batch: list, step: int, gang: RayGang) -> None:
            sender = GroupSender(endpoint, curve=load_client_keys(client_keys["curve_server_key"], client_keys["curve_client_key"]))
            await sender.start()
            try:
                for group in batch:
                    await sender.send(group)
                deadline = time.monotonic() + 240
                while max([r["step"] for r in _metric_lines(run_dir / "metrics.jsonl")], default=0) < step:
                    assert gang.poll() is None and time.monotonic() < deadline, gang.log_tail(40)
                    await asyncio.sleep(0.5)
            finally:
                await sender.close()

        gang = launcher.place("learner-rl", "learner")
        assert isinstance(gang, RayGang) and len({m.node_id for m in gang.members}) == 2
        assert {m.node_id for m in gang.members} <= {n.node_id for n in nodes.values()}
        endpoint = start(gang, "first")
        assert endpoint.startswith(f"tcp://{gang.members[0].host}:")  # bundle 0's node: rank 0 binds there
        asyncio.run(send(endpoint, groups[:4], 2, gang))
        rank1_log = (logs / "learner-first-rank1.log").read_text()
        assert "learner rank 0/2" in (logs / "learner-first.log").read_text() and "learner rank 1/2" in rank1_log
        assert load_latest_checkpoint(run_dir / "checkpoints")["world_size"] == 2
        rank0 = [gang.members[0].pid, int(re.search(r"learner rank 0/2 pid (\d+)", (logs / "learner-first.log").read_text())[1])]
        _private([m.pid for m in gang.members])

        lost = next(name for name, node in nodes.items() if node.node_id == gang.members[1].node_id)
        cluster.remove_node(nodes[lost])
        deadline = time.monotonic() + 90
        while gang.poll() != HOST_LOST and time.monotonic() < deadline:
            time.sleep(0.5)
        assert gang.poll() == HOST_LOST
        again = keeper.replace_slot(gang)
        assert isinstance(again, RayGang) and again is not gang and gang.released
        assert not _gone_within(rank0, 30), "the lost gang's rank 0 outlived it"
        survivors = {n.node_id for name, n in nodes.items() if name != lost}
        assert {m.node_id for m in again.members} == survivors
        endpoint = start(again, "again")
        asyncio.run(send(endpoint, groups[4:], 3, again))
        assert "READY learner step=2" in (logs / "learner-again.log").read_text()
        again.stop(60)
        trained = [gid for record in read_metrics(run_dir / "metrics.jsonl") for gid in record["group_ids"]]
        assert sorted(trained) == sorted(g.group_id for g in groups)
        launcher.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
