"""`[cluster]`: which launcher places a run's roles, and what each kind of role asks of its node.

Pure: no Ray here. `ray_actor_options(kind, cluster)` is the whole placement rule the Ray launcher
applies, so that tests can check it without a cluster.

    [cluster]
    launcher = "ray"                   # "local" (default): every role a child of `agentrl train`
    address = "auto"                   # Ray's own address argument; empty: RAY_ADDRESS, else a new local Ray
    [cluster.tools]
    resource = "agentrl_tools"         # only nodes started with --resources='{"agentrl_tools": N}'
"""

from __future__ import annotations

from dataclasses import field
from typing import Literal

from agentrl.common.config import config_dataclass

RoleKind = Literal["tools", "inference", "learner", "actor"]
ROLE_KINDS: tuple[str, ...] = ("tools", "inference", "learner", "actor")


@config_dataclass
class RoleResources:
    cpus: float = 1.0
    """Ray CPUs reserved for each process of this kind (Ray also sets its OMP_NUM_THREADS from it)."""
    gpus: float = 0.0
    """Ray GPUs reserved for each process of this kind (an inference server's tensor-parallel size)."""
    resource: str = ""
    """A custom resource its node must offer, one unit per process (`ray start --resources='{"NAME": N}'`):
    how a cluster says which nodes run tools, servers or learners. Empty: any node with the CPUs/GPUs."""

    def __post_init__(self) -> None:
        if self.cpus < 0 or self.gpus < 0:
            raise ValueError(f"cpus={self.cpus} and gpus={self.gpus} must be >= 0")


@config_dataclass
class LearnerResources(RoleResources):
    ranks: int = 1
    """Learner processes, one torchrun rank each (FSDP2 across them: learner/distributed.py); each
    asks for `cpus`, `gpus` and `resource`. Rank 0 binds the learner's endpoints and pushes the
    weights. On this host (the local launcher) they are `torchrun --nproc-per-node RANKS`; under Ray,
    one placement group with a bundle per rank, and torchrun on each bundle's node with a static
    rendezvous at rank 0's."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How Ray places the ranks' bundles (its placement group strategies): PACK on as few nodes as
    hold them, STRICT_SPREAD each rank on a node of its own, STRICT_PACK all on one node."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ranks < 1:
            raise ValueError(f"ranks={self.ranks} must be >= 1")
        if self.ranks > 1 and not (self.cpus > 0 or self.gpus > 0 or self.resource):
            raise ValueError(f"ranks={self.ranks}: each rank's bundle must ask for something (cpus, gpus or resource); "
                             "a placement group has no empty bundles")


@config_dataclass
class ClusterConfig:
    launcher: Literal["local", "ray"] = "local"
    """"local": every process a child of `agentrl train` on this host. "ray": each placed on a node of
    a Ray cluster by a host actor there (agentrl/launch/ray_launcher.py; needs `pip install agentrl[ray]`);
    every role then binds its node's address, so the run provisions credentials as off loopback."""
    address: str = ""
    """Ray's `address` argument ("auto", "HOST:PORT", "ray://HOST:10001"); empty: RAY_ADDRESS if set,
    else Ray starts a one-node cluster on this host."""
    place_timeout_s: float = 120.0
    """How long a role may wait for a node with its resources before the run stops with the resources
    it asked for and those the cluster has."""
    tools: RoleResources = field(default_factory=RoleResources)
    """Each tool service replica; replicas of one service are spread over the nodes that offer these."""
    inference: RoleResources = field(default_factory=RoleResources)
    """Each vLLM server (with its own multiprocessing executor inside its reservation); several
    (`services.vllm_replicas`) are spread over the nodes that offer these."""
    learner: LearnerResources = field(default_factory=LearnerResources)
    """The learner's ranks."""
    actor: RoleResources = field(default_factory=RoleResources)
    """The actor (orchestrator)."""

    def __post_init__(self) -> None:
        if not self.place_timeout_s > 0:
            raise ValueError(f"cluster.place_timeout_s={self.place_timeout_s} must be > 0")


def ray_actor_options(kind: str, cluster: ClusterConfig) -> dict:
    """The options of the host actor for one role of `kind`: its reservation, and where it may go."""
    if kind not in ROLE_KINDS:
        raise ValueError(f"unknown role kind {kind!r} (one of {', '.join(ROLE_KINDS)})")
    wants: RoleResources = getattr(cluster, kind)
    return {
        "num_cpus": wants.cpus,
        "num_gpus": wants.gpus,
        "resources": {wants.resource: 1} if wants.resource else {},
        # Replicas of a service (tool replicas, vLLM servers) on different nodes where there are enough.
        "scheduling_strategy": "SPREAD" if kind in ("tools", "inference") else "DEFAULT",
        "max_restarts": 0,  # the supervisor decides what is restarted, and where
        "max_concurrency": 4,  # poll and log_tail answer while a start is still waiting for READY
    }


def placement_bundles(wants: RoleResources, count: int) -> list[dict[str, float]]:
    """The bundles of a placement group of `count` processes that each ask for `wants` (Ray takes
    no zero amounts in a bundle)."""
    bundle = {"CPU": wants.cpus, "GPU": wants.gpus, **({wants.resource: 1} if wants.resource else {})}
    return [{k: v for k, v in bundle.items() if v > 0} for _ in range(count)]

