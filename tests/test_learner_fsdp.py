"""FSDP2 under torchrun: two CPU processes (gloo) take the same optimizer step as one process."""

import json
import os
import socket
import subprocess
import sys

import pytest

from agentrl.learner.distributed import run_check_step


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_fsdp2_two_processes_match_one_process(tmp_path):
    single = run_check_step(rank=0, world=1)
    out = tmp_path / "fsdp.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONSAFEPATH="1")
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(_free_port()), "-m", "agentrl.learner.distributed", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sharded = json.loads(out.read_text())
    assert sharded["world"] == 2
    assert sharded["num_action_tokens"] == single["num_action_tokens"]
    assert sharded["loss"] == pytest.approx(single["loss"], rel=1e-5, abs=1e-7)
    assert sharded["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)
    # The parameters after the AdamW step (lr 1e-2, so a wrong gradient would show).
    assert sharded["param_checksum"] == pytest.approx(single["param_checksum"], rel=1e-6)
