"""Triton kernels for `linear_logprob` (math and contract: `agentrl.kernels.linear_logprob`).

Imported lazily by the CUDA path and by the interpreter tests, so that importing `agentrl.kernels`
neither needs triton nor fixes TRITON_INTERPRET before a test process sets it.

Shape legend: M rows (unmasked tokens), H hidden size, V vocabulary size, C rows per backward
chunk, S vocabulary splits, BM/BV/BH block sizes along M/V/H.

Forward (`_logprob_fwd_kernel`): program (i, s) owns BM rows and the s-th contiguous range of
vocabulary tiles. For each BV-wide tile it accumulates the logits over BH-wide slices of H with
tl.dot (float32 accumulator), then folds the tile into four running sums per row:
    m = running max,  s = sum exp(z - m),  t = sum exp(z - m) (z - m),  tgt = z[target]
rescaling s and t when m grows. Columns >= V are set to -inf before the max and excluded from t,
so any V works (49152 and 151936 alike) and no padded column enters a sum. Keeping t relative to m
keeps the entropy log(s) - t/s free of the cancellation that lse - E[z] suffers at |z| ~ 1e4.
The S partial results are merged on the host side (O(S M)); the split exists so that small M still
fills the GPU (M = 8192 with BM = 64 is only 128 row blocks for 132 SMs).

Backward (`_grad_logits_kernel`): for C rows at a time, program (i, j) recomputes the (BM, BV) logits
tile exactly as the forward did and writes d loss / d logits (in the input dtype) into a [C, V]
buffer; cuBLAS then forms grad_hidden and grad_weight from it. Extra memory is C x V x 2 bytes in
bf16 (about 1 GiB at C = 3456, V = 151936) and no [N, V] tensor exists at any time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# One [C, V] gradient buffer in the backward is kept near 1 GiB: large enough that the two cuBLAS
# matmuls per chunk run near peak (C >= ~2k), small next to the 1.2 GB float32 weight gradient.
_CUDA_CHUNK_BYTES = 2**30


# Vocabulary splits under the interpreter: more than one, so the tests cover the host-side merge.
_INTERPRETER_SPLITS = 3


def _blocks(device: torch.device) -> tuple[int, int, int, int]:
    """(BM, BV, BH, num_warps). Under the interpreter every program is a Python loop, so small tiles
    keep the test shapes quick; on a GPU 64 x 128 x 64 bf16 tiles feed the tensor cores, and 8 warps
    keep the four [64, 128] float32 temporaries of the online softmax in registers (untuned: no GPU
    was available when this was written)."""
    if device.type == "cuda":
        return 64, 128, 64, 8
    return 16, 64, 32, 1


def cuda_chunk_rows(vocab_size: int, element_bytes: int) -> int:
    return max(16, _CUDA_CHUNK_BYTES // (vocab_size * element_bytes) // 16 * 16)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would default to TF32 (10-bit mantissa) on GPUs; "ieee" keeps float32 exact.
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast(tensor: torch.Tensor) -> bool:
    # Triton 3.9's interpreter computes tl.dot on bf16/fp16 tiles wrongly (off by ~1e10 on a 16 x 16
    # product; loads and casts are right), so on CPU tensors (= the interpreter) the tiles are cast to
    # float32 first. On a GPU the tiles go to the tensor cores in their own dtype.
    return tensor.device.type != "cuda" and tensor.dtype != torch.float32


def _check_dtype(tensor: torch.Tensor) -> None:
    if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"the Triton path takes float32, bfloat16 or float16, got {tensor.dtype}")


@triton.jit
def _logprob_fwd_kernel(
    h_ptr, w_ptr, y_ptr, m_out_ptr, s_out_ptr, t_out_ptr, tgt_out_ptr,
    M, V, H, stride_h, stride_w, inv_t, tiles_per_split,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    y = tl.load(y_ptr + rows64, mask=row_ok, other=0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s_i = tl.zeros([BLOCK_M], tl.float32)
    t_i = tl.zeros([BLOCK_M], tl.float32)
    tgt = tl.zeros([BLOCK_M], tl.float32)
    v_begin = split * tiles_per_split * BLOCK_V
    v_end = tl.minimum(v_begin + tiles_per_split * BLOCK_V, V)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        cols64 = cols.to(tl.int64)
        acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
        for h0 in range(0, H, BLOCK_H):
            ks = h0 + tl.arange(0, BLOCK_H)
            k_ok = ks < H
            h_tile = tl.load(h_ptr + rows64[:, None] * stride_h + ks[None, :],
                             mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_tile = tl.load(w_ptr + cols64[:, None] * stride_w + ks[None, :],
                             mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:
                h_tile = h_tile.to(tl.float32)
                w_tile = w_tile.to(tl.float32)
            acc = tl.dot(h_tile, tl.trans(w_tile), acc, input_precision=DOT_PRECISION)
        z = tl.where(col_ok[None, :], acc * inv_t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, axis=1))
        alpha = tl.exp(m_i - m_new)
        e = tl.exp(z - m_new[:, None])
        rel = tl.where(col_ok[None, :], z - m_new[:, None], 0.0)
        # m_i is -inf before the first tile (where s_i == 0): select first, so no -inf * 0 is formed.
        shift = tl.where(s_i > 0, m_i - m_new, 0.0) * s_i
        t_i = alpha * (t_i + shift) + tl.sum(e * rel, axis=1)
        s_i = alpha * s_i + tl.sum(e, axis=1)
        m_i = m_new
        tgt += tl.sum(tl.where(cols[None, :] == y[:, None], z, 0.0), axis=1)

    out = split.to(tl.int64) * M + rows64
    tl.store(m_out_ptr + out, m_i, mask=row_ok)
    tl.store(s_out_ptr + out, s_i, mask=row_ok)
    tl.store(t_out_ptr + out, t_i, mask=row_ok)
    tl.store(tgt_out_ptr + out, tgt, mask=row_ok)


@triton.jit
def _grad_logits_kernel(
    h_ptr, w_ptr, y_ptr, lse_ptr, ent_ptr, g_ptr, e_ptr, out_ptr,
    M, V, H, stride_h, stride_w, stride_out, inv_t,
    HAS_ENTROPY_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < M
    col_ok = cols < V
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        ks = h0 + tl.arange(0, BLOCK_H)
        k_ok = ks < H
        h_tile = tl.load(h_ptr + rows64[:, None] * stride_h + ks[None, :],
                         mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_tile = tl.load(w_ptr + cols64[:, None] * stride_w + ks[None, :],
                         mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            h_tile = h_tile.to(tl.float32)
            w_tile = w_tile.to(tl.float32)
        acc = tl.dot(h_tile, tl.trans(w_tile), acc, input_precision=DOT_PRECISION)

    lse = tl.load(lse_ptr + rows64, mask=row_ok, other=0.0)
    g = tl.load(g_ptr + rows64, mask=row_ok, other=0.0)
    y = tl.load(y_ptr + rows64, mask=row_ok, other=0)
    logp = acc * inv_t - lse[:, None]
    p = tl.exp(logp)
    if HAS_ENTROPY_GRAD:
        ent = tl.load(ent_ptr + rows64, mask=row_ok, other=0.0)
        e_grad = tl.load(e_ptr + rows64, mask=row_ok, other=0.0)
        coef = g[:, None] + e_grad[:, None] * (logp + ent[:, None])
    else:
        coef = g[:, None]
    grad = -p * coef + tl.where(cols[None, :] == y[:, None], g[:, None], 0.0)
    grad = grad * inv_t
    tl.store(out_ptr + rows64[:, None] * stride_out + cols64[None, :], grad.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def forward_triton(
    hidden_MH: torch.Tensor, weight_VH: torch.Tensor, targets_M: torch.Tensor, inv_temperature: float,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs_M, entropy_M, lse_M), float32. num_splits None picks enough vocabulary splits for
    about four programs per SM on a GPU, and 3 under the interpreter (so tests cover the merge)."""
    _check_dtype(hidden_MH)
    hidden_MH = hidden_MH.contiguous()
    weight_VH = weight_VH.contiguous()
    num_rows, hidden_size = hidden_MH.shape
    vocab_size = weight_VH.shape[0]
    block_m, block_v, block_h, num_warps = _blocks(hidden_MH.device)
    num_row_blocks = triton.cdiv(num_rows, block_m)
    num_tiles = triton.cdiv(vocab_size, block_v)
    if num_splits is None:
        if hidden_MH.is_cuda:
            num_sms = torch.cuda.get_device_properties(hidden_MH.device).multi_processor_count
            num_splits = triton.cdiv(4 * num_sms, num_row_blocks)
        else:
            num_splits = _INTERPRETER_SPLITS
    tiles_per_split = triton.cdiv(num_tiles, max(1, min(num_splits, num_tiles)))
    num_splits = triton.cdiv(num_tiles, tiles_per_split)  # no split is left without a tile
    partial = torch.empty(4, num_splits, num_rows, dtype=torch.float32, device=hidden_MH.device)
    _logprob_fwd_kernel[(num_row_blocks, num_splits)](
        hidden_MH, weight_VH, targets_M, partial[0], partial[1], partial[2], partial[3],
        num_rows, vocab_size, hidden_size, hidden_MH.stride(0), weight_VH.stride(0), inv_temperature,
        tiles_per_split,
        BLOCK_M=block_m, BLOCK_V=block_v, BLOCK_H=block_h, DOT_PRECISION=_dot_precision(hidden_MH.dtype),
        UPCAST=_upcast(hidden_MH),
        num_warps=num_warps,
    )
    m_SM, s_SM, t_SM, tgt_SM = partial
    m_M = m_SM.max(0).values
    scale_SM = torch.exp(m_SM - m_M)
    s_M = (s_SM * scale_SM).sum(0)
    t_M = (scale_SM * (t_SM + (m_SM - m_M) * s_SM)).sum(0)
    log_s_M = torch.log(s_M)
    lse_M = m_M + log_s_M
    return tgt_SM.sum(0) - lse_M, log_s_M - t_M / s_M, lse_M


def grad_logits_triton(
    hidden_CH: torch.Tensor, weight_VH: torch.Tensor, targets_C: torch.Tensor, lse_C: torch.Tensor,
    entropy_C: torch.Tensor | None, grad_logprobs_C: torch.Tensor, grad_entropy_C: torch.Tensor | None,
    inv_temperature: float,
) -> torch.Tensor:
    """d loss / d (hidden @ weight.T) for C rows: a [C, V] tensor in the input dtype."""
    _check_dtype(hidden_CH)
    hidden_CH = hidden_CH.contiguous()
    weight_VH = weight_VH.contiguous()
    num_rows, hidden_size = hidden_CH.shape
    vocab_size = weight_VH.shape[0]
    block_m, block_v, block_h, num_warps = _blocks(hidden_CH.device)
    out_CV = torch.empty(num_rows, vocab_size, dtype=hidden_CH.dtype, device=hidden_CH.device)
    has_entropy_grad = grad_entropy_C is not None
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(vocab_size, block_v))
    _grad_logits_kernel[grid](
        hidden_CH, weight_VH, targets_C.contiguous(), lse_C.contiguous(),
        entropy_C.contiguous() if has_entropy_grad else lse_C, grad_logprobs_C.contiguous(),
        grad_entropy_C.contiguous() if has_entropy_grad else lse_C, out_CV,
        num_rows, vocab_size, hidden_size, hidden_CH.stride(0), weight_VH.stride(0), out_CV.stride(0),
        inv_temperature,
        HAS_ENTROPY_GRAD=has_entropy_grad,
        BLOCK_M=block_m, BLOCK_V=block_v, BLOCK_H=block_h, DOT_PRECISION=_dot_precision(hidden_CH.dtype),
        UPCAST=_upcast(hidden_CH),
        num_warps=num_warps,
    )
    return out_CV
