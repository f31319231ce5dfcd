"""Per-token log-prob (and entropy) of target tokens straight from hidden states, never materialising
the [N, V] logits.

Shape legend: N tokens, M unmasked tokens (rows actually computed), H hidden size, V vocabulary
size, C rows per chunk (GPU backward), Vc vocabulary entries per chunk (CPU path), K rows whose
target falls in the current vocabulary chunk.

Math, per unmasked row i with z_i = hidden_i @ weight.T / temperature (float32 accumulation):

    lse_i      = log sum_j exp(z_ij)
    logprob_i  = z_{i, y_i} - lse_i
    entropy_i  = lse_i - sum_j p_ij z_ij,            p_ij = exp(z_ij - lse_i)

and with incoming gradients g_i (of logprob) and e_i (of entropy):

    d/dz_ij = g_i (1[j = y_i] - p_ij) - e_i p_ij (log p_ij + entropy_i)

which the backward turns into grad_hidden = (d/dz) @ weight / temperature and
grad_weight = (d/dz).T @ hidden / temperature, chunk by chunk.

Masked rows are dropped before any arithmetic (an index_select of M rows), so they cost nothing in
forward or backward; their outputs are 0 and their hidden-state gradient is 0.

Two implementations with identical semantics, chosen by device in `linear_logprob`:
- "chunked" (pure torch, CPU): the vocabulary in chunks of Vc rows of the weight (one [M, Vc]
  float32 buffer is about 16 MiB: Vc = 512 at M = 8192) with the same online log-sum-exp as the
  Triton kernel; the backward recomputes each chunk, writes that chunk's rows of grad_weight once
  and accumulates grad_hidden. Peak extra memory: two such buffers + the weight gradient + O(M H),
  instead of several [N, V] tensors (1.6 GB each at N = 8192, V = 49152).
- "triton" (CUDA; `triton_linear_logprob`): a fused forward kernel that streams vocabulary tiles
  through an online log-sum-exp (no [N, V] or [C, V] buffer at all), and a backward that recomputes
  the logits tile by tile in a Triton kernel (float32 accumulation) into a [C, V] buffer of
  d/dz for C rows at a time, followed by two cuBLAS matmuls for the gradients.

Both recompute the logits in backward (one extra 2MHV matmul) rather than keep them: that is the
price of O(M) saved state. Gradients exist for hidden and weight (a tied embedding weight works: it
is an ordinary leaf that also receives the embedding's gradient), not for targets or mask.
"""

from __future__ import annotations

import math

import torch

# About 16 MiB for one [M, Vc] float32 buffer of the vocabulary-chunked CPU path (Vc = 512 at
# M = 8192): at most two are alive at once, so they add ~32 MiB to the float32 weight gradient
# (113 MiB at SmolLM2's V x H), against ~4.8 GB of [N, V] tensors in the materialised path at
# N = 8192. Chunking the vocabulary (not the rows) keeps every matmul tall (M rows) and reads the
# weight once per pass: row chunks of 85 rows re-read the 113 MiB weight and re-wrote the weight
# gradient ~100 times at N = 8192 and ran 2x slower than the materialised path.
_CPU_CHUNK_BYTES = 16 * 2**20


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def cpu_vocab_chunk(num_rows: int, vocab_size: int) -> int:
    """Vc: vocabulary rows per chunk of the CPU path, a multiple of 64 (>= 64, <= V)."""
    return min(vocab_size, max(64, _CPU_CHUNK_BYTES // (4 * max(num_rows, 1)) // 64 * 64))


def _targets_in_chunk(targets_M: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows whose target lies in [start, stop), their target's column within the chunk)."""
    rows_K = ((targets_M >= start) & (targets_M < stop)).nonzero()[:, 0]
    return rows_K, targets_M[rows_K] - start


def _forward_vocab_chunked(
    hidden_MH: torch.Tensor, weight_VH: torch.Tensor, targets_M: torch.Tensor, inv_temperature: float,
    want_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Online log-sum-exp over vocabulary chunks, the torch twin of `_logprob_fwd_kernel`:
    running max m, s = sum exp(z - m), t = sum exp(z - m) (z - m), and the target logit."""
    compute = _compute_dtype(hidden_MH.dtype)
    hidden_c = hidden_MH.to(compute)
    num_rows, vocab_size = hidden_MH.shape[0], weight_VH.shape[0]
    chunk = cpu_vocab_chunk(num_rows, vocab_size)
    device = hidden_MH.device
    max_M = torch.full((num_rows,), -torch.inf, dtype=compute, device=device)
    sum_M = torch.zeros(num_rows, dtype=compute, device=device)
    shifted_sum_M = torch.zeros(num_rows, dtype=compute, device=device)
    target_logit_M = torch.zeros(num_rows, dtype=compute, device=device)
    for start in range(0, vocab_size, chunk):
        stop = min(start + chunk, vocab_size)
        z_MC = hidden_c @ weight_VH[start:stop].to(compute).T
        if inv_temperature != 1.0:  # each skipped pass over [M, Vc] is ~5% of the CPU path's time
            z_MC.mul_(inv_temperature)
        rows_K, cols_K = _targets_in_chunk(targets_M, start, stop)
        target_logit_M[rows_K] = z_MC[rows_K, cols_K]
        new_max_M = torch.maximum(max_M, z_MC.amax(dim=1))
        alpha_M = torch.exp(max_M - new_max_M)  # 0 on the first chunk (max_M = -inf)
        rel_MC = z_MC.sub_(new_max_M[:, None])
        if want_entropy:
            exp_MC = rel_MC.exp()
            chunk_sum_M = exp_MC.sum(1)
            # sum_M is 0 on the first chunk, where (max_M - new_max_M) is -inf: select, never multiply.
            shift_M = torch.where(sum_M > 0, max_M - new_max_M, 0.0) * sum_M
            shifted_sum_M = alpha_M * (shifted_sum_M + shift_M) + exp_MC.mul_(rel_MC).sum(1)
            sum_M = alpha_M * sum_M + chunk_sum_M
            del exp_MC
        else:
            sum_M = alpha_M * sum_M + rel_MC.exp_().sum(1)
        max_M = new_max_M
        del z_MC, rel_MC  # before the next chunk's matmul allocates its buffer
    log_sum_M = sum_M.log()
    lse_M = max_M + log_sum_M
    entropy_M = log_sum_M - shifted_sum_M / sum_M if want_entropy else None
    return target_logit_M - lse_M, entropy_M, lse_M


def _backward_vocab_chunked(
    hidden_MH: torch.Tensor, weight_VH: torch.Tensor, targets_M: torch.Tensor, lse_M: torch.Tensor,
    entropy_M: torch.Tensor | None, grad_logprobs_M: torch.Tensor, grad_entropy_M: torch.Tensor | None,
    inv_temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recompute each vocabulary chunk's logits, form d/dz there, and write that chunk's rows of the
    weight gradient exactly once; the hidden gradient ([M, H], small) accumulates across chunks."""
    compute = _compute_dtype(hidden_MH.dtype)
    hidden_c = hidden_MH.to(compute)
    num_rows, vocab_size = hidden_MH.shape[0], weight_VH.shape[0]
    chunk = cpu_vocab_chunk(num_rows, vocab_size)
    grad_hidden_MH = torch.zeros(hidden_MH.shape, dtype=compute, device=hidden_MH.device)
    grad_weight_VH = torch.empty_like(weight_VH)
    for start in range(0, vocab_size, chunk):
        stop = min(start + chunk, vocab_size)
        weight_c = weight_VH[start:stop].to(compute)
        logp_MC = hidden_c @ weight_c.T
        if inv_temperature != 1.0:
            logp_MC.mul_(inv_temperature)
        logp_MC.sub_(lse_M[:, None])
        if grad_entropy_M is None:
            grad_MC = logp_MC.exp_().mul_(-grad_logprobs_M[:, None])
        else:
            p_MC = logp_MC.exp()
            coef_MC = logp_MC.add_(entropy_M[:, None]).mul_(grad_entropy_M[:, None]).add_(grad_logprobs_M[:, None])
            grad_MC = p_MC.mul_(coef_MC).neg_()
            del coef_MC, logp_MC
        rows_K, cols_K = _targets_in_chunk(targets_M, start, stop)
        grad_MC[rows_K, cols_K] += grad_logprobs_M[rows_K]
        if inv_temperature != 1.0:
            grad_MC.mul_(inv_temperature)
        grad_hidden_MH.addmm_(grad_MC, weight_c)
        grad_weight_VH[start:stop] = grad_MC.T @ hidden_c
        del grad_MC
    return grad_hidden_MH.to(hidden_MH.dtype), grad_weight_VH


def backward_chunked(
    hidden_MH: torch.Tensor, weight_VH: torch.Tensor, chunk_rows: int, grad_logits_fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_hidden [M, H] and grad_weight [V, H] from `grad_logits_fn(rows) -> [C, V]`, C rows at a time.

    The weight gradient is accumulated in float32 (float64 for float64 inputs) across chunks and cast
    once at the end, so bf16 weights do not lose bits to M / C roundings.
    """
    num_rows = hidden_MH.shape[0]
    grad_hidden_MH = torch.empty_like(hidden_MH)
    grad_weight_acc = torch.zeros(weight_VH.shape, dtype=_compute_dtype(weight_VH.dtype), device=weight_VH.device)
    for start in range(0, num_rows, chunk_rows):
        rows = slice(start, start + chunk_rows)
        grad_CV = grad_logits_fn(rows).to(hidden_MH.dtype)
        grad_hidden_MH[rows] = grad_CV @ weight_VH
        if grad_weight_acc.dtype == hidden_MH.dtype:
            grad_weight_acc.addmm_(grad_CV.T, hidden_MH[rows])
        else:
            # In-place add promotes the bf16 product into the float32 accumulator without a float32
            # temporary (the product itself is one [V, H] bf16 temporary: 622 MB at Qwen2.5-3B).
            grad_weight_acc.add_(grad_CV.T @ hidden_MH[rows])
        del grad_CV  # before the next chunk allocates its own
    return grad_hidden_MH, grad_weight_acc.to(weight_VH.dtype)


class LinearLogprobFunction(torch.autograd.Function):
    """(hidden_MH, weight_VH) -> (logprobs_M, entropy_M) over unmasked rows; backend "chunked" or "triton"."""

    @staticmethod
    def forward(ctx, hidden_MH, weight_VH, targets_M, temperature, want_entropy, backend):
        inv_temperature = 1.0 / temperature
        if backend == "chunked":
            logprobs_M, entropy_M, lse_M = _forward_vocab_chunked(
                hidden_MH, weight_VH, targets_M, inv_temperature, want_entropy
            )
        else:
            from agentrl.kernels.triton_linear_logprob import forward_triton

            logprobs_M, entropy_M, lse_M = forward_triton(hidden_MH, weight_VH, targets_M, inv_temperature)
            entropy_M = entropy_M if want_entropy else None
        ctx.save_for_backward(hidden_MH, weight_VH, targets_M, lse_M, entropy_M)
        ctx.inv_temperature = inv_temperature
        ctx.backend = backend
        ctx.set_materialize_grads(False)
        if entropy_M is None:
            return logprobs_M, torch.zeros_like(logprobs_M)
        return logprobs_M, entropy_M

    @staticmethod
    def backward(ctx, grad_logprobs_M, grad_entropy_M):
        hidden_MH, weight_VH, targets_M, lse_M, entropy_M = ctx.saved_tensors
        if grad_logprobs_M is None and grad_entropy_M is None:
            return None, None, None, None, None, None
        if grad_logprobs_M is None:
            grad_logprobs_M = torch.zeros_like(lse_M)
        grad_logprobs_M = grad_logprobs_M.to(lse_M.dtype).contiguous()
        if entropy_M is None:
            grad_entropy_M = None
        elif grad_entropy_M is not None:
            grad_entropy_M = grad_entropy_M.to(lse_M.dtype).contiguous()
        inv_t = ctx.inv_temperature
        entropy_or_none_M = None if grad_entropy_M is None else entropy_M
        if ctx.backend == "chunked":
            grad_hidden_MH, grad_weight_VH = _backward_vocab_chunked(
                hidden_MH, weight_VH, targets_M, lse_M, entropy_or_none_M, grad_logprobs_M, grad_entropy_M, inv_t
            )
        else:
            from agentrl.kernels.triton_linear_logprob import cuda_chunk_rows, grad_logits_triton

            def grad_logits_fn(rows: slice) -> torch.Tensor:
                return grad_logits_triton(
                    hidden_MH[rows], weight_VH, targets_M[rows], lse_M[rows],
                    None if entropy_or_none_M is None else entropy_or_none_M[rows], grad_logprobs_M[rows],
                    None if grad_entropy_M is None else grad_entropy_M[rows], inv_t,
                )

            chunk_rows = cuda_chunk_rows(weight_VH.shape[0], hidden_MH.element_size())
            grad_hidden_MH, grad_weight_VH = backward_chunked(hidden_MH, weight_VH, chunk_rows, grad_logits_fn)
        return (
            grad_hidden_MH if ctx.needs_input_grad[0] else None,
            grad_weight_VH if ctx.needs_input_grad[1] else None,
            None, None, None, None,
        )


def _validate(hidden, weight, targets, mask, temperature) -> None:
    if hidden.dim() != 2 or not hidden.is_floating_point():
        raise ValueError(f"hidden must be a 2-D floating tensor [N, H], got {tuple(hidden.shape)} {hidden.dtype}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight must be [V, H] with H = hidden.shape[1] = {hidden.shape[1]}, got {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype; cast one of them")
    if weight.device != hidden.device:
        raise ValueError(f"hidden is on {hidden.device} but weight is on {weight.device}")
    num_tokens = hidden.shape[0]
    if targets.shape != (num_tokens,) or targets.dtype != torch.int64:
        raise TypeError(f"targets must be int64 [N] = ({num_tokens},), got {tuple(targets.shape)} {targets.dtype}")
    if targets.device != hidden.device:
        raise ValueError(f"targets is on {targets.device} but hidden is on {hidden.device}")
    if mask is not None:
        if mask.shape != (num_tokens,) or mask.dtype != torch.bool:
            raise TypeError(f"mask must be bool [N] = ({num_tokens},) or None, got {tuple(mask.shape)} {mask.dtype}")
        if mask.device != hidden.device:
            raise ValueError(f"mask is on {mask.device} but hidden is on {hidden.device}")
    if not (isinstance(temperature, int | float) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def linear_logprob_with_backend(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    backend: str,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`linear_logprob` with the implementation chosen explicitly: "chunked" or "triton"."""
    if backend not in ("chunked", "triton"):
        raise ValueError(f"backend must be 'chunked' or 'triton', got {backend!r}")
    _validate(hidden, weight, targets, mask, temperature)
    num_tokens, vocab_size = hidden.shape[0], weight.shape[0]
    rows_M = None if mask is None else mask.nonzero()[:, 0]
    hidden_MH = hidden if rows_M is None else hidden.index_select(0, rows_M)
    targets_M = targets if rows_M is None else targets.index_select(0, rows_M)
    if targets_M.numel() and (int(targets_M.min()) < 0 or int(targets_M.max()) >= vocab_size):
        raise ValueError(
            f"unmasked targets must lie in [0, V={vocab_size}), got range "
            f"[{int(targets_M.min())}, {int(targets_M.max())}]; mask out padding positions"
        )
    out_dtype = _compute_dtype(hidden.dtype)
    if hidden_MH.shape[0] == 0:
        # Nothing to compute; keep the graph connected so backward yields zero gradients.
        # Sums over zero rows are exactly 0 (even if hidden holds NaN) and still reach both inputs.
        connected = (hidden[:0].sum() + weight[:0].sum()).to(out_dtype)
        zeros_N = torch.zeros(num_tokens, dtype=out_dtype, device=hidden.device) + connected
        return (zeros_N, zeros_N.clone()) if return_entropy else zeros_N
    logprobs_M, entropy_M = LinearLogprobFunction.apply(
        hidden_MH.contiguous(), weight, targets_M.contiguous(), float(temperature), return_entropy, backend
    )
    if rows_M is None:
        logprobs_N, entropy_N = logprobs_M, entropy_M
    else:
        zeros_N = torch.zeros(num_tokens, dtype=out_dtype, device=hidden.device)
        logprobs_N = zeros_N.index_copy(0, rows_M, logprobs_M)
        entropy_N = zeros_N.index_copy(0, rows_M, entropy_M)
    return (logprobs_N, entropy_N) if return_entropy else logprobs_N


def linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ weight.T / temperature)[targets] per token, without the [N, V] logits.

    hidden [N, H] (may require grad), weight [V, H] (the LM head; a tied embedding weight works),
    targets [N] int64, mask [N] bool or None (None = every row). Returns logprobs [N] in float32
    (float64 for float64 inputs), or (logprobs [N], entropy [N]) with return_entropy=True. Masked
    rows return 0 and get zero gradient; their targets are not read, so padding ids are fine.
    Runs the Triton kernels on CUDA and the chunked torch path elsewhere (same semantics).
    """
    backend = "triton" if hidden.is_cuda else "chunked"
    return linear_logprob_with_backend(
        hidden, weight, targets, mask, temperature, return_entropy, backend=backend
    )
