"""Triton kernel for the per-token terms of the policy loss (math: `agentrl.kernels.policy_loss`).

Imported lazily by `policy_loss` on CUDA (and by the interpreter tests), so that importing
`agentrl.kernels` neither needs triton nor fixes TRITON_INTERPRET before a test can set it. It imports
nothing from the package: the launcher takes the config's scalars, as `_token_terms_torch` does.

Shape legend: N tokens. One program handles BLOCK_N consecutive tokens; every output is per token,
so the kernel is a single pass with no atomics and its result is deterministic. The caller sums the
outputs (a few [N] reductions, N <= ~10^5).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# 1024 tokens per program: the kernel is memory bound (~56 bytes per token: 5 loads, 9 stores of
# float32), so a large block keeps the launch small (32 programs at N = 32768) and every access coalesced.
_BLOCK_N = 1024


@triton.jit
def _policy_loss_kernel(
    log_ratio_ptr, adv_ptr, log_is_ptr, agg_ptr, kl_delta_ptr,
    loss_ptr, dlog_ratio_ptr, dlogp_kl_ptr, ratio_ptr, low_ptr, high_ptr, trunc_ptr, dual_ptr, kl_ptr,
    N, lower, upper, dual_clip, is_cap, kl_coef, kl_clamp,
    HAS_DUAL: tl.constexpr, HAS_IS: tl.constexpr, HAS_KL: tl.constexpr, BLOCK_N: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = offs < N
    log_ratio = tl.load(log_ratio_ptr + offs, mask=valid, other=0.0)
    adv = tl.load(adv_ptr + offs, mask=valid, other=0.0)
    agg = tl.load(agg_ptr + offs, mask=valid, other=0.0)

    ratio = tl.exp(log_ratio)
    unclipped = ratio * adv
    clipped = tl.minimum(tl.maximum(ratio, lower), upper) * adv
    takes_unclipped = unclipped <= clipped  # see _token_terms_torch
    pg = -tl.minimum(unclipped, clipped)
    dpg = tl.where(takes_unclipped, -unclipped, 0.0)
    if HAS_DUAL:
        dual = (adv < 0) & (ratio > dual_clip)
        pg = tl.where(dual, -adv * dual_clip, pg)
        dpg = tl.where(dual, 0.0, dpg)
        tl.store(dual_ptr + offs, tl.where(dual, 1.0, 0.0), mask=valid)
    else:
        tl.store(dual_ptr + offs, tl.zeros(ratio.shape, ratio.dtype), mask=valid)

    if HAS_IS:
        raw_weight = tl.exp(tl.load(log_is_ptr + offs, mask=valid, other=0.0))
        weight = tl.minimum(raw_weight, is_cap)
        tl.store(trunc_ptr + offs, tl.where(raw_weight > is_cap, 1.0, 0.0), mask=valid)
    else:
        weight = tl.full(ratio.shape, 1.0, ratio.dtype)
        tl.store(trunc_ptr + offs, tl.zeros(ratio.shape, ratio.dtype), mask=valid)
    loss = agg * pg * weight
    if HAS_KL:
        raw_delta = tl.load(kl_delta_ptr + offs, mask=valid, other=0.0)
        delta = tl.minimum(tl.maximum(raw_delta, -kl_clamp), kl_clamp)  # policy_loss_config.kl_log_ratio_clamp
        e = tl.exp(delta)
        kl = e - delta - 1.0
        loss += agg * kl_coef * kl
        in_clamp = tl.abs(raw_delta) <= kl_clamp
        tl.store(dlogp_kl_ptr + offs, tl.where(in_clamp, agg * kl_coef * (1.0 - e), 0.0), mask=valid)
        tl.store(kl_ptr + offs, kl, mask=valid)
    else:
        tl.store(dlogp_kl_ptr + offs, tl.zeros(ratio.shape, ratio.dtype), mask=valid)
        tl.store(kl_ptr + offs, tl.zeros(ratio.shape, ratio.dtype), mask=valid)

    tl.store(loss_ptr + offs, loss, mask=valid)
    tl.store(dlog_ratio_ptr + offs, agg * dpg * weight, mask=valid)
    tl.store(ratio_ptr + offs, ratio, mask=valid)
    tl.store(low_ptr + offs, tl.where((adv < 0) & (ratio < lower), 1.0, 0.0), mask=valid)
    tl.store(high_ptr + offs, tl.where((adv > 0) & (ratio > upper), 1.0, 0.0), mask=valid)


def token_terms_triton(
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
    """Same contract as `policy_loss._token_terms_torch` (nine [N] outputs; dual_clip = inf: off)."""
    num_tokens = log_ratio_N.shape[0]
    outputs = [torch.empty_like(log_ratio_N) for _ in range(9)]
    if num_tokens == 0:
        return tuple(outputs)
    inputs = [t.contiguous() for t in (log_ratio_N, adv_N, agg_N)]
    # An unused pointer argument still needs a tensor; log_ratio stands in and is never read for it.
    log_is = log_is_N.contiguous() if log_is_N is not None else inputs[0]
    kl_delta = kl_delta_N.contiguous() if kl_delta_N is not None else inputs[0]
    grid = (triton.cdiv(num_tokens, _BLOCK_N),)
    _policy_loss_kernel[grid](
        inputs[0], inputs[1], log_is, inputs[2], kl_delta, *outputs,
        num_tokens, lower, upper, dual_clip, is_cap, kl_coef, kl_clamp,
        HAS_DUAL=dual_clip < math.inf, HAS_IS=log_is_N is not None, HAS_KL=kl_delta_N is not None,
        BLOCK_N=_BLOCK_N,
    )
    return tuple(outputs)
