#!/usr/bin/env bash
# Runs the test suite in the project's environment. Extra arguments go to pytest.
# pytest exits 5 when it collects no tests; that is a failure here (a suite that ran nothing proves nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${AGENTRL_VENV:-.venv}
exec "$VENV/bin/python" -m pytest -ra "$@"
