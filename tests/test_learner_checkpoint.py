"""Checkpoint I/O: atomic folders, and a re-save of the same step never leaves the step without a
complete checkpoint (a crash between moving the old one aside and renaming the new one in)."""

import os

import torch

from agentrl.learner import checkpoint as C


def _state(marker: float) -> dict:
    return {"policy": {"w": torch.full((2,), marker)}, "step": 5, "ledger": {"trained": {}, "rejected": {}}}


def test_resave_of_the_same_step_replaces_it(tmp_path):
    C.save_checkpoint(tmp_path, 5, _state(1.0), keep=2)
    C.save_checkpoint(tmp_path, 5, _state(2.0), keep=2)
    assert [p.name for p in C.checkpoint_dirs(tmp_path)] == ["step-00000005"]
    assert float(C.load_latest_checkpoint(tmp_path)["policy"]["w"][0]) == 2.0
    assert not list(tmp_path.glob(".replaced-*")) and not list(tmp_path.glob(".tmp-*"))


def test_a_crash_mid_replace_recovers_the_previous_save(tmp_path):
    C.save_checkpoint(tmp_path, 4, _state(0.5), keep=3)
    C.save_checkpoint(tmp_path, 5, _state(1.0), keep=3)
    # The state a crash leaves between step 2 (old folder moved aside) and step 3 (new one renamed in),
    # with the new one half-written.
    os.replace(tmp_path / "step-00000005", tmp_path / ".replaced-step-00000005")
    (tmp_path / ".tmp-step-00000005").mkdir()
    (tmp_path / ".tmp-step-00000005" / "state.pt").write_bytes(b"half")
    state = C.load_latest_checkpoint(tmp_path)
    assert state is not None and float(state["policy"]["w"][0]) == 1.0  # step 5, not step 4
    assert [p.name for p in C.checkpoint_dirs(tmp_path)] == ["step-00000004", "step-00000005"]
    assert not list(tmp_path.glob(".replaced-*")) and not list(tmp_path.glob(".tmp-*"))


def test_keep_prunes_only_after_the_new_one_is_in_place(tmp_path):
    for step in (1, 2, 3):
        C.save_checkpoint(tmp_path, step, {**_state(float(step)), "step": step}, keep=2)
    assert [p.name for p in C.checkpoint_dirs(tmp_path)] == ["step-00000002", "step-00000003"]


def test_policy_weights_drop_the_value_head():
    state = {"policy": {"lm.model.x": torch.zeros(1), "value_head.weight": torch.zeros(1)}}
    assert list(C.policy_weights(state)) == ["lm.model.x"]
