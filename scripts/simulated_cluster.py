"""Run `agentrl train` under the Ray launcher on a simulated Ray cluster on this machine
(`ray.cluster_utils.Cluster`: a head with no CPUs and one node with `--cpus` logical CPUs), then stop
the cluster. Everything after `--` goes to `agentrl train`; the run's JSON line is its last line.

    python scripts/simulated_cluster.py [--cpus 8] [--shared DIR] -- [agentrl train options]

Each role's processes get a /tmp and /dev/shm of their own (agentrl/launch/simulated.py), as on
separate hosts; `--shared` (default: the working directory) is what they share, as hosts share the
run directory's storage: the run's `--out` must be under it.

The main job under the Ray launcher, beside the local one on the same seed:

    python scripts/simulated_cluster.py -- --out runs/main-ray
    agentrl train --out runs/main-local

The vLLM server and the learner each reserve 2 of the node's logical CPUs (Ray sets their
OMP_NUM_THREADS from that, as a local run gives them this machine's threads); `--set` after `--`
overrides it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpus", type=int, default=8, help="logical CPUs of the one worker node (enough for every role)")
    parser.add_argument("--shared", default=".", help="the directory every role sees (the run's --out must be under it)")
    parser.add_argument("train", nargs=argparse.REMAINDER, help="-- then the options of agentrl train")
    args = parser.parse_args(argv)
    train = args.train[1:] if args.train[:1] == ["--"] else args.train

    import ray
    from ray.cluster_utils import Cluster

    from agentrl.launch.simulated import private_mounts_env

    env = {**os.environ, **private_mounts_env([os.path.abspath(args.shared)])}

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=args.cpus)
        cluster.wait_for_nodes()
        print(f"simulated Ray cluster at {cluster.address}: a head with no CPUs, one node with {args.cpus}", file=sys.stderr,
              flush=True)
        command = [sys.executable, "-P", "-m", "agentrl.cli", "train", "--launcher", "ray", "--ray-address", cluster.address,
                   "--set", "cluster.inference.cpus=2", "--set", "cluster.learner.cpus=2", *train]
        return subprocess.run(command, env=env).returncode
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
