"""The local launcher against the Ray launcher on this machine: the same short RL run (no SFT, one
tool service, the real vLLM server, learner and actor), each run from a fresh process, in turns.

For each run: seconds from `agentrl train` starting to the learner's first RL step (the first
record with a loss in rl/metrics.jsonl), and RL episodes per second (episodes / RL minutes of its
JSON line). The Ray runs go to a `ray.cluster_utils.Cluster` this script starts (a head with no CPUs
and one node with this machine's cores, counted as 8 logical CPUs so that every role fits; the
learner and the server reserve 2 each, so Ray gives them this machine's 2 threads, as local runs
have). Before the first run it measures what Ray's own daemons use while idle (CPU time of every
process of the cluster over `--idle-s` seconds, in % of one core). Prints one JSON line last:
medians over `--rounds`, and the ratios ray/local.

Run: python benchmarks/launcher.py [--rounds 1] [--minutes 2.5] [--idle-s 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.runs import train_argv  # noqa: E402

# The tests' tiny run (tests/tiny_run.toml), with the budget of --minutes; the server and the learner
# ask Ray for 2 CPUs each, as many as the machine has.
SETS = ("cluster.inference.cpus=2", "cluster.learner.cpus=2")



def clock_ticks(pids) -> int:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total


def ray_idle_cpu(idle_s: float) -> dict:
    from agentrl.common.proctable import all_processes, descendants

    pids = list(descendants({os.getpid()}, all_processes()))
    before = clock_ticks(pids)
    time.sleep(idle_s)
    used = (clock_ticks(pids) - before) / os.sysconf("SC_CLK_TCK")
    return {"ray_idle_processes": len(pids), "ray_idle_cpu_pct_of_one_core": round(100 * used / idle_s, 2)}


def one_run(launcher: str, minutes: float, out: Path, address: str | None) -> dict:
    argv = train_argv(*SETS, f"minutes={minutes}", out=out, extra=("--launcher", launcher))
    if address:
        argv += ["--ray-address", address]
    log = open(out.parent / f"{out.name}.log", "w")
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
    metrics = out / "rl" / "metrics.jsonl"
    first_step_s = None
    while proc.poll() is None and first_step_s is None:
        if metrics.exists() and any("loss" in json.loads(x) for x in metrics.read_text().splitlines()):
            first_step_s = time.monotonic() - started
        time.sleep(0.5)
    stdout, _ = proc.communicate()
    log.close()
    if proc.returncode != 0 or first_step_s is None:
        raise SystemExit(f"{launcher} run failed (rc {proc.returncode}, first step {first_step_s}); log {log.name}")
    summary = json.loads(stdout.strip().splitlines()[-1])
    rl_s = summary["rl_minutes"] * 60
    return {"first_rl_step_s": round(first_step_s, 1), "episodes": summary["episodes"], "rl_s": round(rl_s, 1),
            "episodes_per_s": round(summary["episodes"] / rl_s, 4), "rl_steps": summary["rl_steps"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--minutes", type=float, default=2.5)
    parser.add_argument("--idle-s", type=float, default=20.0)
    args = parser.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    cluster.add_node(num_cpus=8)
    cluster.wait_for_nodes()
    runs: dict[str, list[dict]] = {"local": [], "ray": []}
    try:
        time.sleep(5.0)
        idle = ray_idle_cpu(args.idle_s)
        with tempfile.TemporaryDirectory(prefix="agentrl-bench-launcher-") as tmp:
            for r in range(args.rounds):
                for launcher in ("local", "ray"):
                    result = one_run(launcher, args.minutes, Path(tmp) / f"{launcher}-{r}", cluster.address if launcher == "ray" else None)
                    print(json.dumps({"launcher": launcher, "round": r, **result}), flush=True)
                    runs[launcher].append(result)
    finally:
        ray.shutdown()
        cluster.shutdown()

    def median(launcher: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[launcher]), 4)

    avx512_bf16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    result = {
        "benchmark": "launcher", "rounds": args.rounds, "minutes": args.minutes,
        "machine_kind": "AVX-512 BF16" if avx512_bf16 else "AVX2-only", "cpu_count": os.cpu_count(),
        "machine": platform.machine(), "ray": ray.__version__,
        "local_first_rl_step_s": median("local", "first_rl_step_s"), "ray_first_rl_step_s": median("ray", "first_rl_step_s"),
        "ray_added_startup_s": round(median("ray", "first_rl_step_s") - median("local", "first_rl_step_s"), 1),
        "local_episodes_per_s": median("local", "episodes_per_s"), "ray_episodes_per_s": median("ray", "episodes_per_s"),
        "ray_over_local_episodes_per_s": round(median("ray", "episodes_per_s") / median("local", "episodes_per_s"), 3),
        **idle,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
