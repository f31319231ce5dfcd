"""A simulated Ray cluster on one machine: the Ray launcher's tests and `scripts/simulated_cluster.py`.

`ray.cluster_utils.Cluster` runs one raylet per simulated node on this machine, so every node would
share this machine's /tmp and /dev/shm, and a role could read what another wrote there as if both
were on one host. `private_mounts_env` closes that: a driver started with it has Ray start every
worker of its job (each host actor, so each role's whole process tree) through bubblewrap in a
mount namespace of its own, with an empty /tmp and /dev/shm. What stays shared is what separate
hosts share: the run directory (the storage every node mounts; README, "A cluster"), Ray's own
session directory (its sockets), and the model and package files, which are read only. What a
role gives another then has to travel over a socket, as it must between hosts.

It uses Ray's job runtime environment (`py_executable`) through the variable that `ray job submit`
sets for its driver, so neither the launcher nor the roles know of it.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

RAY_JOB_CONFIG_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"
RAY_SESSIONS_DIR = "/tmp/ray"
"""Where `ray.cluster_utils.Cluster` keeps its sessions (its raylets' and workers' sockets)."""


def private_mounts_env(shared: Sequence[Path | str]) -> dict[str, str]:
    """Environment for a Ray driver whose workers each see an empty /tmp and /dev/shm of their own,
    with `shared` (directories, e.g. the run's) and Ray's session directory bound through."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise RuntimeError("private mounts per simulated node need bubblewrap (bwrap) on PATH")
    for path in shared:
        if not Path(path).is_dir():
            raise ValueError(f"a shared directory must exist before the workers start: {path}")
    binds = [RAY_SESSIONS_DIR, *map(str, shared)]
    argv = [bwrap, "--dev-bind", "/", "/", "--tmpfs", "/tmp", "--tmpfs", "/dev/shm"]
    for path in binds:
        argv += ["--bind", path, path]
    argv += ["--", sys.executable]
    return {RAY_JOB_CONFIG_VAR: json.dumps({"runtime_env": {"py_executable": shlex.join(argv)}})}


def mount_namespace(pid: int) -> str:
    """The mount namespace of a process ("mnt:[N]"): two processes with private mounts differ."""
    return os.readlink(f"/proc/{pid}/ns/mnt")
