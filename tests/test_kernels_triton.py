"""The Triton kernels, run on the CPU by Triton's interpreter, against the float64 references.

TRITON_INTERPRET must be set before triton is imported, and in a full `pytest tests/` run another
module may already have imported it. So this module never imports triton itself: one fixture runs
this same file as a script in a fresh process with TRITON_INTERPRET=1 (the `__main__` block), which
evaluates every case and prints one JSON line of {case: {metric: [error, bound]}}; each pytest case
then asserts its metrics. A crash in the worker fails every case with the worker's stderr.

Shapes are small and odd (the interpreter runs each program as Python): N = 37, H = 64, V = 1003, and
N = 37, H = 72, V = 1009 (prime, so no block size divides it; H = 72 is not a multiple of BH = 32).
Tolerances are those of test_kernels.py (float32 kernel vs float64 reference), stated there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import pytest

# The worker takes about 10 s on a 2-core machine; the limit only guards against a hang.
WORKER_TIMEOUT_S = 600

CASES = [
    "logprob_n37_h64_v1003",
    "logprob_v1009_h72_temp_one_split_small_chunks",
    "logprob_extreme_logits",
    "logprob_single_token",
    "logprob_all_masked",
    "logprob_bf16",
    "logprob_tied_embedding",
    "policy_loss_configs",
    "policy_loss_all_masked",
    "policy_loss_dual_clip_by_hand",
    "policy_loss_kl_large_gaps",
    "tiny_model_training",
]


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    # The worker imports test_kernels from this folder; with PYTHONSAFEPATH (scripts/test.sh) Python no
    # longer puts a script's own folder on sys.path, so name it.
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S
    )
    assert proc.returncode == 0, f"interpreter worker failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_triton_kernel_under_interpreter(case, interpreter_results):
    result = interpreter_results[case]
    assert "traceback" not in result, result.get("traceback")
    failed = {name: eb for name, eb in result.items() if not eb[0] <= eb[1]}
    assert not failed, f"{case}: [error, bound] over the bound: {failed}"


# ----------------------------------------------------------------------------- worker (own process)


def _worker() -> dict:
    import dataclasses
    import math

    import torch
    from test_kernels import (
        CONFIGS,
        DUAL_CLIP_EXPECTED,
        KL_GAP_CONFIGS,
        KL_GAP_TOLERANCES,
        dual_clip_by_hand,
        kl_gap_case,
        kl_gap_inputs,
        make_logprob_inputs,
        make_loss_inputs,
        run_logprob,
        run_loss,
        train_losses,
    )

    from agentrl.kernels import triton_linear_logprob as tll
    from agentrl.kernels.linear_logprob import linear_logprob_with_backend
    from agentrl.kernels.policy_loss import policy_loss_with_backend
    from agentrl.kernels.reference import linear_logprob_reference, policy_loss_reference

    def triton_logprob(*args):
        return linear_logprob_with_backend(*args, backend="triton")

    def triton_loss(*args, **kwargs):
        return policy_loss_with_backend(*args, **kwargs, backend="triton")

    def err(actual, expected, atol, rtol) -> list[float]:
        actual, expected = actual.detach().double(), expected.detach().double()
        if not torch.isfinite(actual).all():
            return [float("inf"), 0.0]
        error = (actual - expected).abs().max().item() if expected.numel() else 0.0
        return [error, atol + rtol * (expected.abs().max().item() if expected.numel() else 0.0)]

    def logprob_case(inputs, temperature, atol=2e-5, rtol=2e-5, grad_atol=1e-5, grad_rtol=1e-4) -> dict:
        hidden, weight, targets, mask, g_lp, g_ent = inputs
        ref = run_logprob(linear_logprob_reference, hidden.double(), weight.double(), targets, mask, temperature,
                          g_lp, g_ent)
        out = run_logprob(triton_logprob, hidden, weight, targets, mask, temperature, g_lp, g_ent)
        names = ("logprobs", "entropy", "grad_hidden", "grad_weight")
        tols = ((atol, rtol), (atol, rtol), (grad_atol, grad_rtol), (grad_atol, grad_rtol))
        result = {n: err(a, e, *t) for n, a, e, t in zip(names, out, ref, tols, strict=True)}
        if mask is not None:
            result["masked_rows_zero"] = [float((out[0][~mask] != 0).sum() + (out[2][~mask] != 0).sum()), 0.0]
        return result

    def case_basic():
        return logprob_case(make_logprob_inputs(37, 64, 1003), 1.0)

    def case_prime_vocab():
        tll._INTERPRETER_SPLITS = 1
        tll._CUDA_CHUNK_BYTES = 16 * 1009 * 4  # 16-row backward chunks: 3 chunks for 37 rows
        try:
            return logprob_case(make_logprob_inputs(37, 72, 1009, seed=8), 0.7)
        finally:
            tll._INTERPRETER_SPLITS = 3
            tll._CUDA_CHUNK_BYTES = 2**30

    def case_extreme():
        inputs = make_logprob_inputs(23, 64, 1003, seed=3, scale=3e3)
        result = logprob_case(inputs, 1.0, atol=2e-3, rtol=1e-6)
        lp = linear_logprob_reference(inputs[0].double(), inputs[1].double(), inputs[2], inputs[3])
        result["reaches_inf_like_logprobs"] = [-lp.min().item(), float("inf")] if lp.min() < -1e3 else [1.0, 0.0]
        return result

    def case_single_token():
        inputs = list(make_logprob_inputs(1, 64, 1003, seed=4))
        inputs[3] = torch.ones(1, dtype=torch.bool)
        return logprob_case(inputs, 1.0)

    def case_all_masked():
        hidden, weight, targets, _, _, _ = make_logprob_inputs(8, 16, 50)
        hidden.requires_grad_()
        weight.requires_grad_()
        lp, ent = triton_logprob(hidden, weight, torch.full((8,), -100), torch.zeros(8, dtype=torch.bool), 1.0, True)
        (lp.sum() + ent.sum()).backward()
        nonzero = sum(float((t != 0).sum()) for t in (lp, ent, hidden.grad, weight.grad))
        return {"nonzero_values": [nonzero, 0.0]}

    def case_bf16():
        # Reference on the same bf16-rounded inputs in float64; logits accumulate in float32, so the
        # log-probs keep float32 accuracy; gradients are bf16 (8 mantissa bits: 2e-2 relative).
        inputs = make_logprob_inputs(37, 64, 1003, seed=5, dtype=torch.bfloat16)
        hidden, weight, targets, mask, g_lp, g_ent = inputs
        ref = run_logprob(linear_logprob_reference, hidden.double(), weight.double(), targets, mask, 1.0, g_lp, g_ent)
        out = run_logprob(triton_logprob, *inputs[:4], 1.0, g_lp, g_ent)
        return {
            "logprobs": err(out[0], ref[0], 2e-5, 2e-5),
            "entropy": err(out[1], ref[1], 2e-5, 2e-5),
            "grad_hidden": err(out[2], ref[2], 0.0, 2e-2),
            "grad_weight": err(out[3], ref[3], 0.0, 2e-2),
            "grad_dtypes_bf16": [float(out[2].dtype != torch.bfloat16 or out[3].dtype != torch.bfloat16), 0.0],
        }

    def case_tied():
        vocab_size, hidden_size, num_tokens = 97, 24, 29
        tokens = torch.randint(0, vocab_size, (num_tokens + 1,), generator=torch.Generator().manual_seed(6))
        grads = []
        for fn, dtype in ((triton_logprob, torch.float32), (linear_logprob_reference, torch.float64)):
            embedding = torch.nn.Embedding(vocab_size, hidden_size, dtype=dtype)
            embedding.weight.data = torch.randn(vocab_size, hidden_size,
                                                generator=torch.Generator().manual_seed(7)).to(dtype)
            fn(torch.tanh(embedding(tokens[:-1])), embedding.weight, tokens[1:], None).sum().backward()
            grads.append(embedding.weight.grad)
        return {"tied_weight_grad": err(grads[0], grads[1], 1e-5, 1e-4)}

    def case_policy_loss():
        floats, mask, seq_ids = make_loss_inputs()
        result = {}
        for i, config in enumerate(CONFIGS):
            ref = run_loss(policy_loss_reference, [t.double() for t in floats], mask, seq_ids, 5, config)
            out = run_loss(triton_loss, floats, mask, seq_ids, 5, config)
            result[f"c{i}_loss"] = err(out[0], ref[0], 1e-6, 1e-5)
            result[f"c{i}_grad_logprobs"] = err(out[2], ref[2], 1e-7, 1e-5)
            result[f"c{i}_grad_entropy"] = err(out[3], ref[3], 1e-7, 1e-5)
            result[f"c{i}_stat_names"] = [float(sorted(out[1]) != sorted(ref[1])), 0.0]
            for name in ref[1]:
                result[f"c{i}_{name}"] = err(out[1][name], ref[1][name], 1e-6, 1e-5)
        return result

    def case_policy_loss_all_masked():
        floats, _, seq_ids = make_loss_inputs(seed=1)
        mask = torch.zeros(37, dtype=torch.bool)
        result = {}
        for i, config in enumerate(CONFIGS):
            loss, _, g_lp, g_ent = run_loss(triton_loss, floats, mask, seq_ids, 5, config)
            result[f"c{i}_nonzero"] = [float(loss != 0) + float((g_lp != 0).sum() + (g_ent != 0).sum()), 0.0]
        return result

    def case_dual_clip_by_hand():
        # float32 kernel vs the hand values of test_kernels (float32 rounding: 1e-6 relative).
        result = {}
        for name, c, expected in (("c3", 3.0, DUAL_CLIP_EXPECTED[3.0]), ("off", None, DUAL_CLIP_EXPECTED[None]),
                                  ("inf", math.inf, DUAL_CLIP_EXPECTED[None])):
            loss, stats, grad = dual_clip_by_hand(triton_loss, c, dtype=torch.float32)
            result[f"{name}_loss"] = err(loss, torch.tensor(expected["loss"]), 0.0, 1e-6)
            result[f"{name}_grad"] = err(grad, torch.tensor(expected["grad"]), 1e-7, 1e-6)
            if c == 3.0:
                result["c3_dual_clip_frac"] = err(stats["dual_clip_frac"], torch.tensor(expected["dual_clip_frac"]), 1e-7, 0)
        return result

    def case_kl_large_gaps():
        result = {}
        for gap in (100.0, 1000.0):
            for dtype in (torch.float32, torch.bfloat16):
                atol, rtol = KL_GAP_TOLERANCES[dtype]
                for i, config in enumerate(KL_GAP_CONFIGS):
                    key = f"gap{gap:g}_{str(dtype).removeprefix('torch.')}_c{i}"
                    ref, out, mask = kl_gap_case(triton_loss, gap, dtype, config)
                    result[f"{key}_loss"] = err(out[0], ref[0], atol, rtol)
                    result[f"{key}_grad_logprobs"] = err(out[2], ref[2], atol, rtol)
                    result[f"{key}_grad_entropy"] = err(out[3], ref[3], atol, rtol)
                    for name in ref[1]:
                        result[f"{key}_{name}"] = err(out[1][name], ref[1][name], atol, 1e-5)
                    # The KL's gradient is zero where the clamp acts (test_kernels states it).
                    floats, _, seq_ids = kl_gap_inputs(gap, dtype)
                    no_kl = run_loss(triton_loss, floats, mask, seq_ids, 5, dataclasses.replace(config, kl_coef=0.0))
                    clamped = torch.zeros(37, dtype=torch.bool)
                    clamped[0::3] = clamped[1::3] = True
                    clamped &= mask
                    result[f"{key}_clamped_grad_is_pg_only"] = err(out[2][clamped], no_kl[2][clamped], 0.0, 0.0)
        return result

    def case_training():
        fused = torch.tensor(train_losses(triton_logprob, triton_loss))
        ref = torch.tensor(train_losses(linear_logprob_reference, policy_loss_reference))
        return {"losses": err(fused, ref, 1e-5, 1e-4), "moved": [0.0, abs(ref[-1] - ref[0]).item() - 1e-2]}

    cases = {
        "logprob_n37_h64_v1003": case_basic,
        "logprob_v1009_h72_temp_one_split_small_chunks": case_prime_vocab,
        "logprob_extreme_logits": case_extreme,
        "logprob_single_token": case_single_token,
        "logprob_all_masked": case_all_masked,
        "logprob_bf16": case_bf16,
        "logprob_tied_embedding": case_tied,
        "policy_loss_configs": case_policy_loss,
        "policy_loss_all_masked": case_policy_loss_all_masked,
        "policy_loss_dual_clip_by_hand": case_dual_clip_by_hand,
        "policy_loss_kl_large_gaps": case_kl_large_gaps,
        "tiny_model_training": case_training,
    }
    assert list(cases) == CASES
    results = {}
    for name, fn in cases.items():
        try:
            results[name] = fn()
        except Exception:  # reported per case and failed by the pytest side, with the traceback
            results[name] = {"traceback": traceback.format_exc()}
        print(f"{name}: {results[name]}", file=sys.stderr)
    return results


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the pytest fixture does)")
    print(json.dumps(_worker()))
