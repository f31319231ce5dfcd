"""The GRPO-family policy loss on per-token log-probs, forward and backward in one pass.

Shape legend: N tokens (packed sequences, any order), S sequences (`num_seqs`).

The objective (AReaL's decoupled PPO, with DAPO's clip-higher and truncated importance sampling).
For every token t with mask_t = 1, in sequence s(t):

    r_t   = exp(clamp(logp_t - prox_t, -20, 20))                       ratio_level == "token"
    r_t   = exp(clamp(mean_{u in s(t), mask_u}(logp_u - prox_u), -20, 20))  ratio_level == "sequence" (GSPO)
    w_t   = min(exp(prox_t - behav_t), is_cap)      (w_t = 1 when is_cap is None)
    pg_t  = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) * w_t
    kl_t  = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                  (k3 estimator, kl_coef > 0)
    l_t   = pg_t + kl_coef * kl_t - entropy_coef * ent_t

and the loss aggregates l_t over masked tokens:

    token_mean: sum_t mask_t l_t / sum_t mask_t                                   (DAPO)
    seq_mean:   mean over sequences with >= 1 masked token of (sum_{t in s} mask_t l_t / |s|)
    constant:   sum_t mask_t l_t / constant_normaliser                            (Dr. GRPO)

logp_t is pi_theta (differentiable); prox_t (the proximal policy, recomputed by the learner before
the update), behav_t (what the inference engine sampled with) and ref_t are constants. The clamp of
the log-ratio at +-20 keeps exp finite in float32 (exp(20) = 4.9e8) for a token whose proximal
log-prob is -inf-like; its gradient is zero outside the clamp, as torch.clamp's is. In GSPO mode the
gradient flows through the sequence mean (d log r_s / d logp_t = 1 / |s| for the masked tokens of s);
the importance weight w_t stays per token, because the engine/trainer mismatch it corrects is per token.

Statistics (masked-token means, whatever the aggregation): clip_frac_low = share of tokens with
A_t < 0 and r_t < 1 - eps_low (the lower clip zeroes their gradient), clip_frac_high = share with
A_t > 0 and r_t > 1 + eps_high, ratio_mean = mean r_t, is_trunc_frac = share with
exp(prox_t - behav_t) > is_cap, kl = mean kl_t, entropy = mean ent_t, num_tokens = sum mask_t.

Masked tokens may hold anything (padding ids, -inf, NaN): they are replaced by zeros before any
arithmetic, contribute nothing and get zero gradient. An all-masked batch gives loss 0.

Fusion: the loss is a scalar, so d loss / d logp_t is known in the forward pass. One kernel computes,
per token, the loss term, its derivative and the statistics flags; backward only scales the saved
gradient by the incoming scalar. Everything is O(N): the torch path needs no chunking.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The log-ratio clamp (see module docstring): exp(20) = 4.9e8 is finite in float32 and in bf16.
log_ratio_clamp = 20.0

_STAT_NAMES = ("clip_frac_low", "clip_frac_high", "ratio_mean", "is_trunc_frac")


@dataclass
class PolicyLossConfig:
    eps_low: float = 0.2
    """Lower clip: the ratio is clipped at 1 - eps_low (dimensionless, in [0, 1))."""
    eps_high: float = 0.28
    """Upper clip (DAPO clip-higher): the ratio is clipped at 1 + eps_high (dimensionless, >= 0)."""
    is_cap: float | None = 2.0
    """Truncation of the decoupled importance weight pi_prox / pi_behavior (TIS), dimensionless,
    > 0 (math.inf keeps the untruncated weight). None disables the weight (w = 1)."""
    ratio_level: str = "token"
    """"token" (PPO/GRPO) or "sequence" (GSPO: geometric mean of the ratio over a sequence's masked
    tokens)."""
    agg: str = "token_mean"
    """"token_mean" (DAPO), "seq_mean" (mean per sequence, then over sequences) or "constant"
    (Dr. GRPO: sum / constant_normaliser)."""
    constant_normaliser: float | None = None
    """Denominator for agg == "constant", in tokens (e.g. max response tokens x number of sequences)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference policy (per token, nats); needs ref_logprobs when > 0."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (nats), subtracted from the loss; needs entropy when > 0."""

    def __post_init__(self) -> None:
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        if self.is_cap is not None and not self.is_cap > 0:
            raise ValueError(f"is_cap must be > 0 (math.inf for no truncation) or None, got {self.is_cap}")
        if self.ratio_level not in ("token", "sequence"):
            raise ValueError(f"ratio_level must be 'token' or 'sequence', got {self.ratio_level!r}")
        if self.agg not in ("token_mean", "seq_mean", "constant"):
            raise ValueError(f"agg must be 'token_mean', 'seq_mean' or 'constant', got {self.agg!r}")
        if self.agg == "constant":
            if self.constant_normaliser is None or not self.constant_normaliser > 0:
                raise ValueError(
                    "agg='constant' needs constant_normaliser > 0 (e.g. max response tokens x num sequences), "
                    f"got {self.constant_normaliser}"
                )
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(f"kl_coef and entropy_coef must be >= 0, got {self.kl_coef}, {self.entropy_coef}")


def _validate_policy_loss_inputs(
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


def _token_terms_torch(
    log_ratio_N: torch.Tensor,
    adv_N: torch.Tensor,
    log_is_N: torch.Tensor | None,
    agg_N: torch.Tensor,
    kl_delta_N: torch.Tensor | None,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, ...]:
    """Per-token loss term and derivatives, the torch twin of `_policy_loss_kernel`.

    Inputs are float32 (float64 in tests), already zeroed at masked tokens; agg_N carries the mask and
    the aggregation's normaliser. Returns (loss_N, dloss/dlog_ratio_N, dloss/dlogp_N from the KL,
    ratio_N, low_N, high_N, trunc_N).
    """
    ratio = log_ratio_N.exp()
    upper = 1 + config.eps_high
    lower = 1 - config.eps_low
    unclipped = ratio * adv_N
    clipped = ratio.clamp(lower, upper) * adv_N
    # Inside the clip range both terms are equal (and so are their gradients); outside it the min
    # picks the clipped term, a constant, exactly when clipping lowers the objective.
    takes_unclipped = unclipped <= clipped
    pg = -torch.minimum(unclipped, clipped)
    dpg = torch.where(takes_unclipped, -unclipped, torch.zeros_like(unclipped))
    if log_is_N is None:
        weight = torch.ones_like(ratio)
        trunc = torch.zeros_like(ratio)
    else:
        raw = log_is_N.exp()
        weight = raw.clamp(max=config.is_cap)
        trunc = (raw > config.is_cap).to(ratio.dtype)
    loss = agg_N * pg * weight
    dlog_ratio = agg_N * dpg * weight
    if kl_delta_N is None:
        dlogp_kl = torch.zeros_like(ratio)
    else:
        e = kl_delta_N.exp()
        loss = loss + agg_N * config.kl_coef * (e - kl_delta_N - 1)
        dlogp_kl = agg_N * config.kl_coef * (1 - e)
    low = ((adv_N < 0) & (ratio < lower)).to(ratio.dtype)
    high = ((adv_N > 0) & (ratio > upper)).to(ratio.dtype)
    return loss, dlog_ratio, dlogp_kl, ratio, low, high, trunc


def _token_terms(backend: str, *args, config: PolicyLossConfig) -> tuple[torch.Tensor, ...]:
    if backend == "torch":
        return _token_terms_torch(*args, config)
    if backend == "triton":
        from agentrl.kernels.triton_policy_loss import token_terms_triton

        return token_terms_triton(*args, config)
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

        loss_N, dlog_ratio_N, dlogp_kl_N, ratio_N, low_N, high_N, trunc_N = _token_terms(
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

        stats = [masked_mean(low_N), masked_mean(high_N), masked_mean(ratio_N), masked_mean(trunc_N)]
        stats.append(masked_mean(kl_delta_N.exp() - kl_delta_N - 1) if kl_delta_N is not None else zero)
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
    _validate_policy_loss_inputs(
        logprobs, proximal_logprobs, behavior_logprobs, advantages, mask, seq_ids, num_seqs, config,
        ref_logprobs, entropy,
    )
    loss, stats_vec = PolicyLossFunction.apply(
        logprobs, entropy, proximal_logprobs, behavior_logprobs, advantages, mask, seq_ids, ref_logprobs,
        num_seqs, config, backend,
    )
    stats = dict(zip(_STAT_NAMES, stats_vec[:4], strict=True))
    if config.kl_coef > 0:
        stats["kl"] = stats_vec[4]
    if entropy is not None:
        stats["entropy"] = stats_vec[5]
    stats["num_tokens"] = stats_vec[6]
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
    dict: clip_frac_low, clip_frac_high, ratio_mean, is_trunc_frac, kl (when kl_coef > 0), entropy
    (when given), num_tokens. Uses the Triton kernel on CUDA and the torch path elsewhere.
    """
    backend = "triton" if logprobs.is_cuda else "torch"
    return policy_loss_with_backend(
        logprobs, proximal_logprobs, behavior_logprobs, advantages, mask, seq_ids, num_seqs=num_seqs,
        config=config, ref_logprobs=ref_logprobs, entropy=entropy, backend=backend,
    )


__all__ = ["PolicyLossConfig", "policy_loss", "policy_loss_with_backend", "PolicyLossFunction", "log_ratio_clamp"]
