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
# Two pytest-xdist workers (AGENTRL_TEST_WORKERS=1: one process, no xdist): the tests that start
# whole processes or use the session's vLLM server run in order on one of them (tests/conftest.py),
# the rest on the other, which would otherwise wait behind them.
WORKERS=${AGENTRL_TEST_WORKERS:-2}
PARALLEL=()
if [ "$WORKERS" -gt 1 ]; then
  PARALLEL=(-n "$WORKERS" --dist loadgroup)
fi
# --durations: the slowest tests, so that a suite growing past its time budget says where.
exec "$VENV/bin/python" -P -m pytest -ra --durations=40 "${PARALLEL[@]}" "$@"
