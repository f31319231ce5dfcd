"""Validation of the policy loss's inputs (shapes, dtypes, devices, config), shared by the fused path
(`policy_loss.py`) and the reference (`reference.py`). Shape legend: `agentrl.kernels.policy_loss`."""

from __future__ import annotations

import torch

from agentrl.kernels.policy_loss_config import PolicyLossConfig


def validate_policy_loss_inputs(
    logprobs_N: torch.Tensor,
    proximal_logprobs_N: torch.Tensor,
    behavior_logprobs_N: torch.Tensor | None,
    advantages_N: torch.Tensor,
    mask_N: torch.Tensor,
    seq_ids_N: torch.Tensor,
    num_seqs: int,
    config: PolicyLossConfig,
    ref_logprobs_N: torch.Tensor | None,
    entropy_N: torch.Tensor | None,
) -> None:
    if not isinstance(config, PolicyLossConfig):
        raise TypeError(f"config must be a PolicyLossConfig, got {type(config).__name__}")
    if logprobs_N.dim() != 1:
        raise ValueError(f"logprobs must be 1-D [N] (packed tokens), got shape {tuple(logprobs_N.shape)}")
    num_tokens = logprobs_N.shape[0]
    floats = {
        "logprobs": logprobs_N,
        "proximal_logprobs": proximal_logprobs_N,
        "behavior_logprobs": behavior_logprobs_N,
        "advantages": advantages_N,
        "ref_logprobs": ref_logprobs_N,
        "entropy": entropy_N,
    }
    for name, tensor in floats.items():
        if tensor is None:
            continue
        if tensor.shape != (num_tokens,):
            raise ValueError(f"{name} must have shape [N] = ({num_tokens},), got {tuple(tensor.shape)}")
        if not tensor.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
        if tensor.device != logprobs_N.device:
            raise ValueError(f"{name} is on {tensor.device} but logprobs is on {logprobs_N.device}")
    for name, tensor, dtype in (("mask", mask_N, torch.bool), ("seq_ids", seq_ids_N, torch.int64)):
        if tensor.shape != (num_tokens,):
            raise ValueError(f"{name} must have shape [N] = ({num_tokens},), got {tuple(tensor.shape)}")
        if tensor.dtype != dtype:
            raise TypeError(f"{name} must be {dtype}, got {tensor.dtype}")
        if tensor.device != logprobs_N.device:
            raise ValueError(f"{name} is on {tensor.device} but logprobs is on {logprobs_N.device}")
    if not isinstance(num_seqs, int) or num_seqs < 1:
        raise ValueError(f"num_seqs must be a positive int, got {num_seqs!r}")
    if num_tokens and (int(seq_ids_N.min()) < 0 or int(seq_ids_N.max()) >= num_seqs):
        raise ValueError(
            f"seq_ids must lie in [0, num_seqs={num_seqs}), got range [{int(seq_ids_N.min())}, {int(seq_ids_N.max())}]"
        )
    if config.is_cap is not None and behavior_logprobs_N is None:
        raise ValueError("behavior_logprobs is required when config.is_cap is set (set is_cap=None to disable the IS weight)")
    if config.kl_coef > 0 and ref_logprobs_N is None:
        raise ValueError("config.kl_coef > 0 needs ref_logprobs")
    if config.entropy_coef > 0 and entropy_N is None:
        raise ValueError("config.entropy_coef > 0 needs entropy (linear_logprob(..., return_entropy=True))")
