"""The python tool's cgroups (v1): where this process may make them, the CPU quota a sandbox may
have under its parents', emptying one, removing those a killed server left, reading a counter."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

CGROUP_CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000


def cgroup_roots() -> dict[str, Path]:
    """This process's own cgroup directory per controller (cgroup v1), each writable."""
    own: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            own[controller] = path
    roots = {}
    for controller in CGROUP_CONTROLLERS:
        root = Path("/sys/fs/cgroup") / controller / own.get(controller, "/").lstrip("/")
        if controller not in own or not os.access(root, os.W_OK):
            raise RuntimeError(
                f"cannot create {controller} cgroups (needs root and cgroup v1 {controller} mounted "
                f"read-write at /sys/fs/cgroup/{controller}); set cgroups = false "
                "([services.python] of a run config, or --no-cgroups) to rely on per-process rlimits only, which bound neither the total "
                "memory nor the total CPU of a call's processes"
            )
        roots[controller] = root
    return roots


def cpu_quota_us(cpu_cores: float, parent: Path) -> int:
    """A sandbox cgroup's cpu.cfs_quota_us for `cpu_cores` per CPU_PERIOD_US, no more than the
    quota of its parent cgroup or of any cgroup above it allows: cgroup v1 refuses (EINVAL) a child
    quota above the nearest one set above it, and that one bounds the child anyway. A server in a
    container held to under one core (or run by scripts/slow_kind.sh) otherwise could not start its
    sandboxes."""
    quota_us = int(cpu_cores * CPU_PERIOD_US)
    group = parent
    while (group / "cpu.cfs_quota_us").is_file():
        group_quota_us = int((group / "cpu.cfs_quota_us").read_text())
        if group_quota_us > 0:  # -1: no quota of its own
            group_period_us = int((group / "cpu.cfs_period_us").read_text())
            quota_us = min(quota_us, group_quota_us * CPU_PERIOD_US // group_period_us)
        group = group.parent
    return quota_us


def empty_cgroup(cgroup: Path, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while pids := (cgroup / "cgroup.procs").read_text().split():
        if time.monotonic() > end:
            raise RuntimeError(f"processes {pids} still in {cgroup} after SIGKILL and {timeout_s} s")
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass  # exited between the read and the kill
        time.sleep(0.005)


def remove_stale_cgroups(root: Path) -> None:
    """Remove empty slot cgroups left by servers that were SIGKILLed (they cannot clean up)."""
    for cgroup in root.glob("agentrl-sandbox-*-*"):
        owner_pid = int(cgroup.name.split("-")[2])
        if owner_pid != os.getpid() and not Path(f"/proc/{owner_pid}").exists():
            if not (cgroup / "cgroup.procs").read_text().strip():
                cgroup.rmdir()


def counter(path: Path, key: str) -> int:
    for line in path.read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    raise RuntimeError(f"{path} has no {key!r} line")
