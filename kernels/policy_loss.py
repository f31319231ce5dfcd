"""The GRPO-family policy loss on per-token log-probs, forward and backward in one pass.

Shape legend: N tokens (packed sequences, any order), S sequences (`num_seqs`).

The objective (AReaL's decoupled PPO, with DAPO's clip-higher, the dual clip and truncated
importance sampling). For every token t with mask_t = 1, in sequence s(t):

    r_t   = exp(clamp(logp_t - prox_t, -20, 20))                       ratio_level == "token"
    r_t   = exp(clamp(mean_{u in s(t), mask_u}(logp_u - prox_u), -20, 20))  ratio_level == "sequence" (GSPO)
    w_t   = min(exp(prox_t - behav_t), is_cap)      (w_t = 1 when is_cap is None)
    pg_t  = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))
    pg_t  = min(pg_t, -A_t c)      for A_t < 0 (dual clip, clip_ratio_c = c; default 3, None: off)
    d_t   = clamp(ref_t - logp_t, -20, 20)
    kl_t  = exp(d_t) - d_t - 1                                            (k3 estimator, kl_coef > 0)
    l_t   = pg_t w_t + kl_coef * kl_t - entropy_coef * ent_t

and the loss aggregates l_t over masked tokens:

    token_mean: sum_t mask_t l_t / sum_t mask_t                                   (DAPO)
    seq_mean:   mean over sequences with >= 1 masked token of (sum_{t in s} mask_t l_t / |s|)
    constant:   sum_t mask_t l_t / constant_normaliser                            (Dr. GRPO)

logp_t is pi_theta (differentiable); prox_t (the proximal policy, recomputed by the learner before
the update), behav_t (what the inference engine sampled with) and ref_t are constants. The clamps of
the log-ratios at +-20 keep exp finite in float32 (exp(20) = 4.9e8; `policy_loss_config` says why
for each); the gradient is zero outside a clamp, as torch.clamp's is. In GSPO mode the gradient flows
through the sequence mean (d log r_s / d logp_t = 1 / |s| for the masked tokens of s); the
importance weight w_t stays per token, because the engine/trainer mismatch it corrects is per token.
The dual clip: for A_t < 0 and r_t > c > 1, max(r_t, clip(r_t)) = r_t, so pg_t = -A_t c, a constant
(zero gradient); everywhere else it leaves pg_t as it was.

Statistics (masked-token means, whatever the aggregation): clip_frac_low = share of tokens with
A_t < 0 and r_t < 1 - eps_low (the lower clip zeroes their gradient), clip_frac_high = share with
A_t > 0 and r_t > 1 + eps_high, dual_clip_frac = share with A_t < 0 and r_t > c (when it is on),
ratio_mean = mean r_t, is_trunc_frac = share with exp(prox_t - behav_t) > is_cap, kl = mean kl_t,
entropy = mean ent_t, num_tokens = sum mask_t.

Masked tokens may hold anything (padding ids, -inf, NaN): they are replaced by zeros before any
arithmetic, contribute nothing and get zero gradient. An all-masked batch gives loss 0.

Fusion: the loss is a scalar, so d loss / d logp_t is known in the forward pass. One kernel computes,
per token, the loss term, its derivative and the statistics flags; backward only scales the saved
gradient by the incoming scalar. Everything is O(N): the torch path needs no chunking.
"""

from __future__ import annotations

import math

import torch

from agentrl.kernels.policy_loss_config import (
    PolicyLossConfig,
    kl_log_ratio_clamp,
    log_ratio_clamp,
)
from agentrl.kernels.policy_loss_inputs import validate_policy_loss_inputs

_STAT_NAMES = ("clip_frac_low", "clip_frac_high", "ratio_mean", "is_trunc_frac")


def _token_terms_torch(
    log_ratio_N: torch.Tensor,
    adv_N: torch.Tensor,
    log_is_N: torch.Tensor | None,
    agg_N: torch.Tensor,
    kl_delta_N: torch.Tensor | None,
    *,
    lower: float,
    upper: float,
    dual_clip: float,
    is_cap: float,
    kl_coef: float,
    kl_clamp: float,
) -> tuple[torch.Tensor, ...]:
    """Per-token loss term and derivatives, the torch twin of `_policy_loss_kernel`.

    Inputs are float32 (float64 in tests), already zeroed at masked tokens; log_ratio_N is clamped,
    kl_delta_N (ref - logp) is not: the KL clamp and its zero gradient live here, beside the KL.
    agg_N carries the mask and the aggregation's normaliser. lower / upper are the clip bounds
    1 -+ eps, dual_clip the dual-clip bound c (math.inf: off). Returns (loss_N, dloss/dlog_ratio_N,
    dloss/dlogp_N from the KL, ratio_N, low_N, high_N, trunc_N, dual_N, kl_N).
    """
    ratio = log_ratio_N.exp()
    unclipped = ratio * adv_N
    clipped = ratio.clamp(lower, upper) * adv_N
    # Inside the clip range both terms are equal (and so are their gradients); outside it the min
    # picks the clipped term, a constant, exactly when clipping lowers the objective.
    takes_unclipped = unclipped <= clipped
    pg = -torch.minimum(unclipped, clipped)
    dpg = torch.where(takes_unclipped, -unclipped, torch.zeros_like(unclipped))
    if dual_clip < math.inf:
        # Dual clip: r > c > 1 with A < 0 is on the unclipped branch, whose -A r the bound replaces
        # by the constant -A c (policy_loss docstring).
        dual = ((adv_N < 0) & (ratio > dual_clip)).to(ratio.dtype)
        pg = torch.where(dual > 0, -adv_N * dual_clip, pg)
        dpg = torch.where(dual > 0, torch.zeros_like(dpg), dpg)
    else:
        dual = torch.zeros_like(ratio)
    if log_is_N is None:
        weight = torch.ones_like(ratio)
        trunc = torch.zeros_like(ratio)
    else:
        raw = log_is_N.exp()
        weight = raw.clamp(max=is_cap)
        trunc = (raw > is_cap).to(ratio.dtype)
    loss = agg_N * pg * weight
    dlog_ratio = agg_N * dpg * weight
    if kl_delta_N is None:
        dlogp_kl = torch.zeros_like(ratio)
        kl = torch.zeros_like(ratio)
    else:
        delta = kl_delta_N.clamp(-kl_clamp, kl_clamp)
        e = delta.exp()
        kl = e - delta - 1
        loss = loss + agg_N * kl_coef * kl
        in_clamp = kl_delta_N.abs() <= kl_clamp  # inclusive, as torch.clamp's gradient
        dlogp_kl = torch.where(in_clamp, agg_N * kl_coef * (1 - e), torch.zeros_like(e))
    low = ((adv_N < 0) & (ratio < lower)).to(ratio.dtype)
    high = ((adv_N > 0) & (ratio > upper)).to(ratio.dtype)
    return loss, dlog_ratio, dlogp_kl, ratio, low, high, trunc, dual, kl


def _token_terms(backend: str, *tensors: torch.Tensor | None, config: PolicyLossConfig) -> tuple[torch.Tensor, ...]:
    scalars = dict(
        lower=1.0 - config.eps_low,
        upper=1.0 + config.eps_high,
        dual_clip=config.dual_clip_bound,
        is_cap=float(config.is_cap) if config.is_cap is not None else 1.0,  # unread without the IS weight
        kl_coef=float(config.kl_coef),
        kl_clamp=kl_log_ratio_clamp,
    )
    if backend == "torch":
        return _token_terms_torch(*tensors, **scalars)
    if backend == "triton":
        from agentrl.kernels.triton_policy_loss import token_terms_triton

        return token_terms_triton(*tensors, **scalars)
    raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}")


class PolicyLossFunction(torch.autograd.Function):
    """loss and stats from (logprobs, entropy); the gradient is computed in forward and saved."""

    @staticmethod
    def forward(ctx, logprobs_N, entropy_N, proximal_N, behavior_N, advantages_N, mask_N, seq_ids_N,
                ref_N, num_seqs, config, backend):
        dtype = torch.float64 if logprobs_N.dtype == torch.float64 else torch.float32
        zero = torch.zeros((), dtype=dtype, device=logprobs_N.device)

        def valid(x: torch.Tensor) -> torch.Tensor:
            return torch.where(mask_N, x.detach().to(dtype), zero)

        m = mask_N.to(dtype)
        num_tokens = m.sum()
        tokens_per_seq_S = torch.zeros(num_seqs, dtype=dtype, device=m.device).index_add_(0, seq_ids_N, m)
        if config.agg == "token_mean":
            agg_N = m / num_tokens.clamp(min=1)
        elif config.agg == "seq_mean":
            num_nonempty = (tokens_per_seq_S > 0).sum().clamp(min=1)
            agg_N = m / (tokens_per_seq_S.clamp(min=1)[seq_ids_N] * num_nonempty)
        else:
            agg_N = m / config.constant_normaliser

        logp = valid(logprobs_N)
        raw_log_ratio = logp - valid(proximal_N)
        if config.ratio_level == "sequence":
            seq_mean_S = torch.zeros(num_seqs, dtype=dtype, device=m.device).index_add_(0, seq_ids_N, raw_log_ratio)
            seq_mean_S = seq_mean_S / tokens_per_seq_S.clamp(min=1)
            log_ratio_N = torch.where(mask_N, seq_mean_S.clamp(-log_ratio_clamp, log_ratio_clamp)[seq_ids_N], zero)
        else:
            log_ratio_N = raw_log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
        log_is_N = None if config.is_cap is None else valid(proximal_N) - valid(behavior_N)
        kl_delta_N = valid(ref_N) - logp if config.kl_coef > 0 else None

        loss_N, dlog_ratio_N, dlogp_kl_N, ratio_N, low_N, high_N, trunc_N, dual_N, kl_N = _token_terms(
            backend, log_ratio_N, valid(advantages_N), log_is_N, agg_N, kl_delta_N, config=config
        )

        if config.ratio_level == "sequence":
            in_clamp_S = seq_mean_S.abs() <= log_ratio_clamp
            dseq_S = torch.zeros(num_seqs, dtype=dtype, device=m.device).index_add_(0, seq_ids_N, dlog_ratio_N)
            dseq_S = torch.where(in_clamp_S, dseq_S / tokens_per_seq_S.clamp(min=1), zero)
            grad_logp_N = dseq_S[seq_ids_N] * m + dlogp_kl_N
        else:
            grad_logp_N = torch.where(raw_log_ratio.abs() <= log_ratio_clamp, dlog_ratio_N, zero) + dlogp_kl_N

        loss = loss_N.sum()
        grad_entropy_N = None
        if entropy_N is not None:
            loss = loss - config.entropy_coef * (agg_N * valid(entropy_N)).sum()
            grad_entropy_N = -config.entropy_coef * agg_N

        def masked_mean(x_N: torch.Tensor) -> torch.Tensor:
            return (x_N * m).sum() / num_tokens.clamp(min=1)

        # Laid out as _STAT_NAMES, then kl, entropy and num_tokens (zeros where they do not apply).
        stats = [masked_mean(x_N) for x_N in (low_N, high_N, ratio_N, trunc_N, dual_N)]
        stats.append(masked_mean(kl_N) if kl_delta_N is not None else zero)
        stats.append(masked_mean(valid(entropy_N)) if entropy_N is not None else zero)
        stats.append(num_tokens)
        stats_vec = torch.stack(stats)
        ctx.mark_non_differentiable(stats_vec)
        ctx.save_for_backward(grad_logp_N, grad_entropy_N)
        ctx.input_dtypes = (logprobs_N.dtype, None if entropy_N is None else entropy_N.dtype)
        return loss.to(logprobs_N.dtype), stats_vec

    @staticmethod
    def backward(ctx, grad_loss, grad_stats):
        grad_logp_N, grad_entropy_N = ctx.saved_tensors
        logp_dtype, entropy_dtype = ctx.input_dtypes
        grad_logp = (grad_logp_N * grad_loss).to(logp_dtype) if ctx.needs_input_grad[0] else None
        grad_entropy = None
        if ctx.needs_input_grad[1] and grad_entropy_N is not None:
            grad_entropy = (grad_entropy_N * grad_loss).to(entropy_dtype)
        return grad_logp, grad_entropy, None, None, None, None, None, None, None, None, None


def policy_loss_with_backend(
    logprobs, proximal_logprobs, behavior_logprobs, advantages, mask, seq_ids, *, num_seqs, config,
    ref_logprobs=None, entropy=None, backend: str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`policy_loss` with the per-token kernel chosen explicitly ("torch" or "triton")."""
    validate_policy_loss_inputs(
        logprobs, proximal_logprobs, behavior_logprobs, advantages, mask, seq_ids, num_seqs, config,
        ref_logprobs, entropy,
    )
    loss, stats_vec = PolicyLossFunction.apply(
        logprobs, entropy, proximal_logprobs, behavior_logprobs, advantages, mask, seq_ids, ref_logprobs,
        num_seqs, config, backend,
    )
    stats = dict(zip(_STAT_NAMES, stats_vec[:4], strict=True))
    if config.dual_clip_on:
        stats["dual_clip_frac"] = stats_vec[4]
    if config.kl_coef > 0:
        stats["kl"] = stats_vec[5]
    if entropy is not None:
        stats["entropy"] = stats_vec[6]
    stats["num_tokens"] = stats_vec[7]
    return loss, stats


def policy_loss(
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
    """The GRPO-family loss (module docstring) and its statistics.

    All tensors are [N] over packed tokens: logprobs (pi_theta, requires grad), proximal_logprobs,
    behavior_logprobs (None allowed only with config.is_cap=None), advantages (per token; broadcast a
    sequence's advantage to its tokens), mask (bool, True = action token), seq_ids (int64 in
    [0, num_seqs)), ref_logprobs (needed when kl_coef > 0), entropy (per-token entropy, may require
    grad; needed when entropy_coef > 0). Returns the scalar loss (logprobs' dtype) and the stats
    dict: clip_frac_low, clip_frac_high, ratio_mean, is_trunc_frac, dual_clip_frac (when the dual
    clip is on), kl (when kl_coef > 0), entropy (when given), num_tokens. Uses the Triton
    kernel on CUDA and the torch path elsewhere.
    """
    backend = "triton" if logprobs.is_cuda else "torch"
    return policy_loss_with_backend(
        logprobs, proximal_logprobs, behavior_logprobs, advantages, mask, seq_ids, num_seqs=num_seqs,
        config=config, ref_logprobs=ref_logprobs, entropy=entropy, backend=backend,
    )


__all__ = [
    "PolicyLossConfig",
    "policy_loss",
    "policy_loss_with_backend",
    "PolicyLossFunction",
    "log_ratio_clamp",
    "kl_log_ratio_clamp",
]
