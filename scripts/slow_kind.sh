#!/usr/bin/env bash
# Runs a command held to the slower machine kind's speed on a faster one (AVX-512 BF16 -> AVX2-only).
#
#   scripts/slow_kind.sh [--cores C] -- COMMAND [ARG...]
#
# Two things make the slower kind slower, and both are emulated:
# - no native bf16: `AGENTRL_CPU_BF16=0` makes "auto" choose float32 for the vLLM server and the
#   learner (agentrl/common/hardware.py), as it does on that kind;
# - slower float32 arithmetic: the command and every process it starts run in a cgroup whose CPU
#   quota is C cores (cgroup v1 cpu.cfs_quota_us, or v2 cpu.max), shared by all of them.
# C defaults to AGENTRL_SLOW_CORES or 0.76, calibrated on the figure of issue 24 measured on the slower
# kind (2-core AMD EPYC, AVX2 only): the SFT phase's learner at 265-270 training tokens/s
# (docs/notes/issue-24.md gives the calibration runs). Needs root (it writes the cgroup).
set -euo pipefail

cores=${AGENTRL_SLOW_CORES:-0.76}
while (($#)); do
  case $1 in
    --cores) cores=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [--cores C] -- COMMAND [ARG...]" >&2; exit 2 ;;
  esac
done
(($#)) || { echo "usage: $0 [--cores C] -- COMMAND [ARG...]" >&2; exit 2; }

period_us=100000
quota_us=$(python3 -c "import sys; c = float(sys.argv[1]); assert 0 < c <= 64, c; print(int(c * $period_us))" "$cores")
name="agentrl-slow-$$"
if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then  # cgroup v2
  group=/sys/fs/cgroup/$name
  mkdir "$group"
  echo "$quota_us $period_us" > "$group/cpu.max"
else  # cgroup v1
  group=/sys/fs/cgroup/cpu/$name
  mkdir "$group"
  echo "$period_us" > "$group/cpu.cfs_period_us"
  echo "$quota_us" > "$group/cpu.cfs_quota_us"
fi
echo "[slow_kind] $group: $cores cores of CPU time, AGENTRL_CPU_BF16=0 (float32)" >&2

# The command runs as a child in the cgroup; this shell stays outside it to remove the cgroup after.
set +e
AGENTRL_CPU_BF16=0 bash -c 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"' slow_kind "$group" "$@"
rc=$?
set -e
# A cgroup can be removed only once empty: the command's processes are gone when it returns, unless
# it left some behind, which this names instead of killing.
if ! rmdir "$group" 2>/dev/null; then
  echo "[slow_kind] $group still holds processes: $(tr '\n' ' ' < "$group/cgroup.procs")" >&2
fi
exit $rc
