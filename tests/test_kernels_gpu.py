"""The Triton kernels compiled for a real GPU, against float64 references on the same device.

Skipped without CUDA; benchmarks/gpu_check.sh runs them on a CUDA machine. Shapes are the real
heads: SmolLM2 (H = 576, V = 49152) and Qwen2.5-3B (H = 2048, V = 151936, not a multiple of the
128-wide vocabulary tile). Tolerances as in test_kernels.py for float32 (tl.dot runs with
input_precision="ieee", so float32 stays float32); for bf16 inputs the reference is computed in
float64 on the same bf16-rounded values, log-probs keep float32 accuracy (float32 accumulation over
H = 2048 products: 1e-4 relative), gradients are bf16 (2e-2 relative of the largest entry).
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import (
    CONFIGS,
    assert_close,
    config_id,
    make_logprob_inputs,
    make_loss_inputs,
    run_logprob,
    run_loss,
)

from agentrl.kernels.linear_logprob import linear_logprob, linear_logprob_with_backend
from agentrl.kernels.policy_loss import policy_loss
from agentrl.kernels.reference import linear_logprob_reference, policy_loss_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run benchmarks/gpu_check.sh on a GPU)"),
]


def to_cuda(inputs):
    return [t.cuda() for t in inputs]


@pytest.mark.parametrize("shape", [(300, 576, 49152), (257, 2048, 151936)], ids=["smollm2", "qwen3b"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_triton_logprob_fp32_matches_reference(shape, temperature):
    hidden, weight, targets, mask, g_lp, g_ent = to_cuda(make_logprob_inputs(*shape, seed=shape[0]))
    ref = run_logprob(linear_logprob_reference, hidden.double(), weight.double(), targets, mask, temperature, g_lp, g_ent)
    out = run_logprob(linear_logprob, hidden, weight, targets, mask, temperature, g_lp, g_ent)
    for name, a, e, atol, rtol in zip(("logprobs", "entropy", "grad_hidden", "grad_weight"), out, ref,
                                      (2e-5, 2e-5, 1e-5, 1e-5), (2e-5, 2e-5, 1e-4, 1e-4), strict=True):
        assert_close(a, e, atol, rtol, name)
    assert (out[0][~mask] == 0).all() and (out[2][~mask] == 0).all()


def test_triton_logprob_bf16_matches_reference_at_qwen_shape():
    hidden, weight, targets, mask, g_lp, g_ent = to_cuda(make_logprob_inputs(1024, 2048, 151936, seed=3,
                                                                              dtype=torch.bfloat16))
    ref = run_logprob(linear_logprob_reference, hidden.double(), weight.double(), targets, mask, 1.0, g_lp, g_ent)
    out = run_logprob(linear_logprob, hidden, weight, targets, mask, 1.0, g_lp, g_ent)
    assert out[2].dtype == torch.bfloat16 and out[3].dtype == torch.bfloat16
    assert_close(out[0], ref[0], 1e-4, 1e-4, "logprobs")
    assert_close(out[1], ref[1], 1e-4, 1e-4, "entropy")
    assert_close(out[2], ref[2], 0.0, 2e-2, "grad_hidden")
    assert_close(out[3], ref[3], 0.0, 2e-2, "grad_weight")


def test_triton_and_chunked_paths_agree_on_gpu():
    inputs = to_cuda(make_logprob_inputs(700, 576, 49152, seed=9))
    hidden, weight, targets, mask, g_lp, g_ent = inputs

    def chunked(*args):
        return linear_logprob_with_backend(*args, backend="chunked")

    a = run_logprob(linear_logprob, hidden, weight, targets, mask, 1.0, g_lp, g_ent)
    b = run_logprob(chunked, hidden, weight, targets, mask, 1.0, g_lp, g_ent)
    for name, x, y in zip(("logprobs", "entropy", "grad_hidden", "grad_weight"), a, b, strict=True):
        assert_close(x, y, 2e-5, 1e-4, name)


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_triton_policy_loss_matches_reference(config):
    floats, mask, seq_ids = make_loss_inputs(num_tokens=4099, num_seqs=37, seed=4)
    floats, mask, seq_ids = to_cuda(floats), mask.cuda(), seq_ids.cuda()
    ref = run_loss(policy_loss_reference, [t.double() for t in floats], mask, seq_ids, 37, config)
    out = run_loss(policy_loss, floats, mask, seq_ids, 37, config)
    assert_close(out[0], ref[0], 1e-6, 1e-5, "loss")
    assert_close(out[2], ref[2], 1e-7, 1e-5, "grad logprobs")
    assert_close(out[3], ref[3], 1e-7, 1e-5, "grad entropy")
    for name in ref[1]:
        assert_close(out[1][name], ref[1][name], 1e-6, 1e-5, name)
