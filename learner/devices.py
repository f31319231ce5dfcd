"""The learner's device (`LearnerConfig.device`): which torch device a rank trains on."""

from __future__ import annotations

import os

import torch


def pick_device(name: str, num_cuda_devices: int, local_rank: int | None) -> torch.device:
    """The device for `LearnerConfig.device` on a host with `num_cuda_devices` visible GPUs;
    `local_rank` is torchrun's LOCAL_RANK (None for one process). Pure: `resolve_device` feeds it."""
    if name == "cpu" or (name == "auto" and num_cuda_devices == 0):
        return torch.device("cpu")
    if name not in ("auto", "cuda"):
        raise ValueError(f"device={name!r}: choose 'auto', 'cpu' or 'cuda'")
    if num_cuda_devices == 0:
        raise RuntimeError(
            f"device = 'cuda' but torch sees no CUDA device (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): set "
            "device = 'cpu' (or 'auto') in the learner config, or run on a GPU host with a CUDA build of torch")
    index = local_rank or 0
    if index >= num_cuda_devices:
        raise RuntimeError(
            f"torchrun LOCAL_RANK={index} but only {num_cuda_devices} CUDA device(s) are visible: one learner "
            f"rank per GPU, so start at most --nproc_per_node {num_cuda_devices} (or set device = 'cpu')")
    return torch.device("cuda", index)


def resolve_device(name: str) -> torch.device:
    """`pick_device` for this process (torchrun's LOCAL_RANK, the GPUs torch sees)."""
    local_rank = int(os.environ["LOCAL_RANK"]) if "RANK" in os.environ and "LOCAL_RANK" in os.environ else None
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pick_device(name, num_gpus, local_rank)

