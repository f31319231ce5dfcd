"""scripts/test.sh runs the suite as two pytest processes (`--part`, tests/conftest.py): the whole
runs (and the `alone` tests) in one, everything else in the other. Together they must run every
test once, and the script's exit status must say whether both passed; a selection that runs
nothing is a failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_TESTS = {
    "tests/test_train_e2e.py::test_train_survives_killed_search_replica_and_learner",
    "tests/test_train_chaos.py::test_train_finishes_when_one_of_two_servers_is_killed",
    "tests/test_toolservers_fault.py::test_sigkill_one_of_two_search_replicas_mid_load",
}


def _collected(*args: str) -> set[str]:
    proc = subprocess.run([sys.executable, "-P", "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return {line for line in proc.stdout.splitlines() if "::" in line}


def test_the_two_parts_run_every_test_once_and_the_runs_are_in_one():
    everything = _collected("tests/test_train_e2e.py", "tests/test_train_chaos.py", "tests/test_toolservers_fault.py",
                            "tests/test_train_signal.py")
    processes = _collected("--part", "processes", "tests/test_train_e2e.py", "tests/test_train_chaos.py",
                           "tests/test_toolservers_fault.py", "tests/test_train_signal.py")
    rest = _collected("--part", "rest", "tests/test_train_e2e.py", "tests/test_train_chaos.py",
                      "tests/test_toolservers_fault.py", "tests/test_train_signal.py")
    assert processes | rest == everything and not processes & rest
    assert RUN_TESTS <= processes
    # test_train_signal.py's quick checks of the no-signal rule run beside; its whole run does not.
    assert any("test_train_signal.py::test_no_signal" in t for t in rest)
    assert "tests/test_train_signal.py::test_a_run_without_signal_stops_its_rl_phase_and_says_why" in processes


def _test_sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["scripts/test.sh", "-p", "no:cacheprovider", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600, env={**os.environ, "AGENTRL_VENV": str(Path(sys.executable).parents[1])})


def test_the_script_passes_when_one_part_has_nothing_and_fails_when_both_have_nothing_or_a_test_fails(tmp_path):
    # tests/test_docs.py has no run: the processes part collects nothing (pytest's 5), the rest passes.
    one = _test_sh("tests/test_docs.py")
    assert one.returncode == 0, one.stdout[-3000:]
    assert "exit 5 (--part processes), 0 (--part rest)" in one.stdout
    none = _test_sh("tests/test_docs.py", "-k", "no_test_has_this_name")
    assert none.returncode == 5, none.stdout[-3000:]
    # A failing test (outside tests/, with a conftest that takes --part and selects nothing by it).
    (tmp_path / "conftest.py").write_text('def pytest_addoption(parser):\n    parser.addoption("--part")\n')
    (tmp_path / "test_fails.py").write_text("def test_fails():\n    assert False\n")
    failed = _test_sh(str(tmp_path / "test_fails.py"))
    assert failed.returncode == 1, failed.stdout[-3000:]
    assert "exit 1 (--part processes), 1 (--part rest)" in failed.stdout
