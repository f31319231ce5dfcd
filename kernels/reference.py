"""Plain-PyTorch references for the fused kernels: readable, materialising, autograd-driven.

These are the specification the fused paths are tested against (in float64 in the tests) and the
"materialised" baseline of `benchmarks/kernels.py`. They build the full `[N, V]` logits, so they
are only for tests, small inputs and benchmarks; the learner calls `agentrl.kernels.linear_logprob`
and `agentrl.kernels.policy_loss`.

Shape legend: N tokens (packed sequences), H hidden size, V vocabulary size, S sequences.
The public arguments keep the public API's names; they are [N] (or [N, H], [V, H]) tensors.

Arithmetic precision: inputs in float64 stay float64; anything narrower is computed in float32 after
the matmul (the matmul itself runs in the input dtype, as a model's LM head does).
"""

from __future__ import annotations

import torch

from agentrl.kernels.policy_loss_config import (
    PolicyLossConfig,
    kl_log_ratio_clamp,
    log_ratio_clamp,
)
from agentrl.kernels.policy_loss_inputs import validate_policy_loss_inputs


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def linear_logprob_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ weight.T / temperature)[target] per row, and the softmax's entropy.

    Masked rows return 0 and, because their outputs are replaced by a constant, get zero gradient.
    """
    logits_NV = (hidden @ weight.T).to(_compute_dtype(hidden.dtype)) / temperature
    logp_NV = torch.log_softmax(logits_NV, dim=-1)
    logprobs = logp_NV.gather(1, targets.clamp(0, weight.shape[0] - 1)[:, None])[:, 0]
    if mask is not None:
        logprobs = torch.where(mask, logprobs, torch.zeros_like(logprobs))
    if not return_entropy:
        return logprobs
    entropy = -(logp_NV.exp() * logp_NV).sum(-1)
    if mask is not None:
        entropy = torch.where(mask, entropy, torch.zeros_like(entropy))
    return logprobs, entropy


def _segment_sum(values_N: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    return torch.zeros(num_seqs, dtype=values_N.dtype, device=values_N.device).index_add(0, seq_ids, values_N)


def policy_loss_reference(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    *,
    num_seqs: int,
    config: PolicyLossConfig,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO-family loss written as directly as the math in `agentrl.kernels.policy_loss`."""
    validate_policy_loss_inputs(
        logprobs, proximal_logprobs, behavior_logprobs, advantages, mask, seq_ids,
        num_seqs, config, ref_logprobs, entropy,
    )
    dtype = _compute_dtype(logprobs.dtype)

    def valid(x: torch.Tensor) -> torch.Tensor:
        # Masked tokens may hold anything (padding, -inf); they must not reach the arithmetic.
        return torch.where(mask, x.to(dtype), torch.zeros((), dtype=dtype, device=x.device))

    logp = valid(logprobs)
    prox = valid(proximal_logprobs.detach())
    adv = valid(advantages.detach())
    m = mask.to(dtype)
    num_tokens = m.sum()
    tokens_per_seq_S = _segment_sum(m, seq_ids, num_seqs)

    if config.ratio_level == "token":
        log_ratio = (logp - prox).clamp(-log_ratio_clamp, log_ratio_clamp)
    else:
        seq_mean_S = _segment_sum((logp - prox) * m, seq_ids, num_seqs) / tokens_per_seq_S.clamp(min=1)
        log_ratio = seq_mean_S.clamp(-log_ratio_clamp, log_ratio_clamp)[seq_ids]
    ratio = log_ratio.exp()
    clipped_ratio = ratio.clamp(1 - config.eps_low, 1 + config.eps_high)
    pg_loss = -torch.minimum(ratio * adv, clipped_ratio * adv)
    dual_clipped = torch.zeros_like(m)
    if config.dual_clip_on:
        # verl's form: min(max(-A r, -A clip(r)), -A c) for A < 0.
        dual_bound = -adv * config.dual_clip_bound
        dual_clipped = ((adv < 0) & (pg_loss > dual_bound)).to(dtype)
        pg_loss = torch.where(adv < 0, torch.minimum(pg_loss, dual_bound), pg_loss)

    if config.is_cap is None:
        is_weight = torch.ones_like(logp)
        is_truncated = torch.zeros_like(m)
    else:
        raw_weight = (prox - valid(behavior_logprobs.detach())).exp()
        is_weight = raw_weight.clamp(max=config.is_cap)
        is_truncated = (raw_weight > config.is_cap).to(dtype)
    loss_tok = pg_loss * is_weight

    stats: dict[str, torch.Tensor] = {}
    if config.kl_coef > 0:
        delta = (valid(ref_logprobs.detach()) - logp).clamp(-kl_log_ratio_clamp, kl_log_ratio_clamp)
        kl_tok = delta.exp() - delta - 1
        loss_tok = loss_tok + config.kl_coef * kl_tok
        stats["kl"] = (kl_tok * m).sum() / num_tokens.clamp(min=1)
    if entropy is not None:
        ent = valid(entropy)
        loss_tok = loss_tok - config.entropy_coef * ent
        stats["entropy"] = (ent.detach() * m).sum() / num_tokens.clamp(min=1)

    if config.agg == "token_mean":
        loss = (loss_tok * m).sum() / num_tokens.clamp(min=1)
    elif config.agg == "seq_mean":
        per_seq_S = _segment_sum(loss_tok * m, seq_ids, num_seqs) / tokens_per_seq_S.clamp(min=1)
        loss = per_seq_S.sum() / (tokens_per_seq_S > 0).sum().clamp(min=1)
    else:
        loss = (loss_tok * m).sum() / config.constant_normaliser

    def masked_mean(x: torch.Tensor) -> torch.Tensor:
        return (x.detach() * m).sum() / num_tokens.clamp(min=1)

    stats["clip_frac_low"] = masked_mean(((adv < 0) & (ratio < 1 - config.eps_low)).to(dtype))
    stats["clip_frac_high"] = masked_mean(((adv > 0) & (ratio > 1 + config.eps_high)).to(dtype))
    if config.dual_clip_on:
        stats["dual_clip_frac"] = masked_mean(dual_clipped)
    stats["ratio_mean"] = masked_mean(ratio)
    stats["is_trunc_frac"] = masked_mean(is_truncated)
    stats["num_tokens"] = num_tokens.detach()
    return loss, stats
