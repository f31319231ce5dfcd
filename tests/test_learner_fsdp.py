"""FSDP2 under torchrun: two CPU processes (gloo) take the same optimizer step as one process,
on an even batch, on one where a rank must run a padding micro-batch, and with LoRA adapters
training (every weight frozen) on the even batch."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.fsdp_check import CHECK_BATCHES, run_check_step

FSDP_CHECK = Path(__file__).parent / "support" / "fsdp_check.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_fsdp2_two_processes_match_one_process(tmp_path):
    single = {batch: run_check_step(rank=0, world=1, batch=batch) for batch in CHECK_BATCHES}
    out = tmp_path / "fsdp.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONSAFEPATH="1")
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(_free_port()), str(FSDP_CHECK), "--out", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            # torchrun puts each rank in its own session: killing the launcher would orphan them, so
            # SIGTERM it and let it stop its ranks (it SIGKILLs them after its 30 s shutdown timeout).
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate(timeout=30)
    assert proc.returncode == 0, output[-6000:]
    results = json.loads(out.read_text())
    assert results["groups"]["num_padding_rows"] == 0
    assert results["uneven"]["num_padding_rows"] == 1  # rank 0's one long sequence against rank 1's two rows
    for batch in CHECK_BATCHES:
        sharded, one = results[batch], single[batch]
        assert sharded["world"] == 2
        assert sharded["num_action_tokens"] == one["num_action_tokens"]
        assert sharded["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7), batch
        assert sharded["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4), batch
        # The parameters after the AdamW step (lr 1e-2, so a wrong gradient would show).
        assert sharded["param_checksum"] == pytest.approx(one["param_checksum"], rel=1e-6), batch
        # The weights the service publishes: gathered from the shards, named and cast as in one process.
        assert sharded["snapshot_keys"] == one["snapshot_keys"] and "lm_head.weight" not in one["snapshot_keys"]
        assert sharded["snapshot_checksum"] == pytest.approx(one["snapshot_checksum"], rel=1e-6), batch
    lora_sharded, lora_one = results["lora-groups"], run_check_step(rank=0, world=1, batch="groups", lora=True)
    assert lora_sharded["loss"] == pytest.approx(lora_one["loss"], rel=1e-5, abs=1e-7)
    assert lora_sharded["grad_norm"] == pytest.approx(lora_one["grad_norm"], rel=1e-4)
    assert lora_sharded["param_checksum"] == pytest.approx(lora_one["param_checksum"], rel=1e-6)
    # A LoRA push is the adapter: peft's file names, gathered from the shards as in one process.
    assert lora_sharded["snapshot_keys"] == lora_one["snapshot_keys"]
    assert lora_one["snapshot_keys"] and all(".lora_" in k for k in lora_one["snapshot_keys"])
    assert lora_sharded["snapshot_checksum"] == pytest.approx(lora_one["snapshot_checksum"], rel=1e-6)
    assert lora_one["param_checksum"] != pytest.approx(results["groups"]["param_checksum"], rel=1e-3)
