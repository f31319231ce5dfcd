#!/usr/bin/env bash
# Runs the test suite in the project's environment. Extra arguments go to pytest.
# pytest exits 5 when it collects no tests; that is a failure here (a suite that ran nothing proves nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${AGENTRL_VENV:-.venv}
# -P: do not put the repository root on sys.path. Its top-level kernels/ folder (agentrl.kernels
# once installed) would otherwise be importable as `kernels`, the name of a Hugging Face package
# that transformers probes for. Child processes inherit PYTHONSAFEPATH for the same reason.
export PYTHONSAFEPATH=1
PYTEST=("$VENV/bin/python" -P -m pytest -ra)
# --durations: the slowest tests, so that a suite growing past its time budget says where.
if [[ ${AGENTRL_TEST_SPLIT:-1} == 0 ]]; then  # one pytest process, e.g. under a debugger
  exec "${PYTEST[@]}" --durations=40 "$@"
fi
# Two pytest processes side by side (tests/conftest.py, --part): one runs, in order, the tests that
# use the session's vLLM server or start servers or runs; the other the rest, which would otherwise
# wait behind them. Its output follows when both are done.
rest_log=$(mktemp -t agentrl-tests-rest.XXXXXX)
"${PYTEST[@]}" --durations=20 --part rest "$@" >"$rest_log" 2>&1 &
rest_pid=$!
trap 'kill "$rest_pid" 2>/dev/null; rm -f "$rest_log"' EXIT
set +e
"${PYTEST[@]}" --durations=40 --part processes "$@"
processes_rc=$?
wait "$rest_pid"
rest_rc=$?
trap - EXIT
echo
echo "=== scripts/test.sh: the tests beside them (--part rest) ==="
cat "$rest_log"
rm -f "$rest_log"
echo "=== scripts/test.sh: exit $processes_rc (--part processes), $rest_rc (--part rest) ==="
# 5 = no test collected. One part may have none (a run of one file); both none is a failure.
if [[ $processes_rc == 5 && $rest_rc == 5 ]]; then
  exit 5
fi
[[ $processes_rc == 5 ]] && processes_rc=0
[[ $rest_rc == 5 ]] && rest_rc=0
if [[ $processes_rc != 0 ]]; then
  exit "$processes_rc"
fi
exit "$rest_rc"
