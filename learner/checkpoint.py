"""Checkpoint I/O: atomic checkpoint folders, RNG state, and the policy weights another learner starts from.

A checkpoint is one folder `step-{step:08d}/state.pt` holding everything a learner resumes from:
policy, optimizer, scheduler, every generator's state, step, version and the ledger (ledger.py
says why the ledger must travel with the weights). Writes are atomic and never leave a moment
without a complete checkpoint of the newest step:

1. the state is written to `.tmp-step-N/` (file fsynced, folder fsynced);
2. if `step-N/` already exists (a learner that checkpoints again at the same step, e.g. on SIGTERM
   right after a periodic save, with a larger ledger), it is first renamed to `.replaced-step-N/`;
3. `.tmp-step-N/` is renamed to `step-N/`, the root fsynced; only then are `.replaced-step-N/` and
   the checkpoints beyond `keep` deleted.

A crash between 2 and 3 leaves `.replaced-step-N/` and no `step-N/`: `load_latest_checkpoint` puts
it back. Its ledger is older than the one being written, but the spool files it does not cover
are still on disk (the spool is pruned only after a save completes), so nothing is lost.
"""

from __future__ import annotations

import io
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentrl.common.files import fsync_dir

CHECKPOINT_PREFIX = "step-"
REPLACED_PREFIX = ".replaced-"
VALUE_HEAD_PREFIX = "value_head."
"""The learner's own critic (GAE); never part of the policy another learner or a server receives."""


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """The generators' states; with a CUDA `device` also that device's generator ("cuda")."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Inverse of `rng_state`. A "cuda" entry is restored onto a CUDA `device`; on the CPU there is no
    CUDA generator to restore it into (a GPU run resumed on the CPU), and a checkpoint without one
    (a CPU run resumed on a GPU) leaves the CUDA generator as `torch.manual_seed` set it."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def to_cpu(obj: Any) -> Any:
    """`obj` with every tensor inside (dicts, lists, tuples) on the CPU; CPU tensors are kept as they
    are, so a CPU learner's state is saved unchanged. Tensors sharing one CUDA storage (a tied
    embedding / LM head) stay shared on the CPU: the checkpoint holds the matrix once."""
    copies: dict[tuple, torch.Tensor] = {}

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.device.type == "cpu":
                return x
            key = (x.device, x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype)
            if key not in copies:
                copies[key] = x.detach().cpu()
            return copies[key]
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        if type(x) in (list, tuple):
            return type(x)(move(v) for v in x)
        return x

    return move(obj)


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint folder (`step-00000028`) holds."""
    return int(path.name[len(CHECKPOINT_PREFIX):])


def checkpoint_dirs(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and (p / "state.pt").is_file()]
    return sorted(found, key=checkpoint_step)


def save_checkpoint(root: Path, step: int, state: dict[str, Any], *, keep: int) -> Path:
    """Write `state` (torch-serialisable) as checkpoint `step` atomically; keep the newest `keep`.
    Tensors are written from the CPU (`to_cpu`): a checkpoint loads on any host."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{CHECKPOINT_PREFIX}{step:08d}"
    tmp = root / f".tmp-{final.name}"
    replaced = root / f"{REPLACED_PREFIX}{final.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    buf = io.BytesIO()
    torch.save(to_cpu(state), buf)
    with open(tmp / "state.pt", "wb") as f:
        f.write(buf.getbuffer())
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    if final.exists():
        if replaced.exists():
            shutil.rmtree(replaced)
        os.replace(final, replaced)
    os.replace(tmp, final)
    fsync_dir(root)
    if replaced.exists():
        shutil.rmtree(replaced)
    for old in checkpoint_dirs(root)[:-keep]:
        shutil.rmtree(old)
    return final


def _recover(root: Path) -> None:
    """Finish or undo what a crash interrupted (module docstring)."""
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale)
    for replaced in root.glob(f"{REPLACED_PREFIX}*"):
        final = root / replaced.name[len(REPLACED_PREFIX):]
        if final.exists():
            shutil.rmtree(replaced)
        else:
            os.replace(replaced, final)
    fsync_dir(root)


def load_latest_checkpoint(root: Path) -> dict[str, Any] | None:
    if not root.is_dir():
        return None
    _recover(root)
    dirs = checkpoint_dirs(root)
    if not dirs:
        return None
    # On the CPU: the learner moves what it loads to its device (load_state_dict copies into the
    # parameters; the optimizer casts its state to each parameter's device).
    return torch.load(dirs[-1] / "state.pt", weights_only=False, map_location="cpu")


def policy_weights(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The policy's weights in a checkpoint state (`PackedPolicy` keys), without the value head."""
    return {k: v for k, v in state["policy"].items() if not k.startswith(VALUE_HEAD_PREFIX)}


def world_size_mismatch(checkpoints: Path, written_by: int, world: int) -> str:
    how = "without torchrun" if written_by == 1 else f"under torchrun --nproc_per_node {written_by}"
    return (f"the latest checkpoint in {checkpoints} was written by {written_by} rank(s) and this learner runs "
            f"{world}: resume it {how} (the optimizer state is laid out per world size), or start a new "
            "output_dir with init_checkpoint pointing at that folder (weights and version carry over, the "
            "optimizer starts fresh)")
