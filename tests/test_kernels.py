"""CPU tests of the kernels' torch paths against the float64 references.

Shape legend: N tokens, H hidden, V vocabulary, S sequences.

Tolerances (float32 fused path vs float64 reference): log-probs and entropies 2e-5 abs + 2e-5 rel,
gradients 1e-5 abs + 1e-4 rel of the largest reference entry. float32 has 24 mantissa bits, so at
|logit| ~ 10 a single rounding is ~1e-6; the bounds leave 10x room for the H-long dot products and
the log-sum-exp, and fail by orders of magnitude on any real error (a wrong sign, a padded column,
a missed mask is >= 1e-2). The Triton kernels are tested in test_kernels_triton.py.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import math
from pathlib import Path

import pytest
import torch

from agentrl.kernels.linear_logprob import cpu_vocab_chunk, linear_logprob
from agentrl.kernels.policy_loss import policy_loss
from agentrl.kernels.policy_loss_config import PolicyLossConfig
from agentrl.kernels.reference import linear_logprob_reference, policy_loss_reference

linear_logprob_module = importlib.import_module("agentrl.kernels.linear_logprob")


@pytest.fixture(params=["one_chunk", "many_chunks"])
def vocab_chunking(request, monkeypatch):
    """The CPU path either fits V = 1003 in one chunk or crosses 16 chunks of 64 (the last partial),
    so the online log-sum-exp's rescaling between chunks is exercised at small shapes too."""
    if request.param == "many_chunks":
        monkeypatch.setattr(linear_logprob_module, "_CPU_CHUNK_BYTES", 1)
    return request.param


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str) -> None:
    actual = actual.detach().double()
    expected = expected.detach().double()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    bound = atol + rtol * expected.abs().max().item()
    err = (actual - expected).abs().max().item() if expected.numel() else 0.0
    assert err <= bound, f"{what}: max abs error {err:.3e} > {bound:.3e}"


def make_logprob_inputs(num_tokens, hidden_size, vocab_size, *, seed=0, scale=1.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden_NH = torch.randn(num_tokens, hidden_size, generator=gen) * scale
    weight_VH = torch.randn(vocab_size, hidden_size, generator=gen) / math.sqrt(hidden_size) * 4
    targets_N = torch.randint(0, vocab_size, (num_tokens,), generator=gen)
    mask_N = torch.rand(num_tokens, generator=gen) > 0.3
    grad_lp_N = torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    grad_ent_N = torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    return hidden_NH.to(dtype), weight_VH.to(dtype), targets_N, mask_N, grad_lp_N, grad_ent_N


def run_logprob(fn, hidden_NH, weight_VH, targets_N, mask_N, temperature, grad_lp_N, grad_ent_N):
    hidden = hidden_NH.detach().clone().requires_grad_()
    weight = weight_VH.detach().clone().requires_grad_()
    lp_N, ent_N = fn(hidden, weight, targets_N, mask_N, temperature, True)
    ((lp_N.double() * grad_lp_N).sum() + (ent_N.double() * grad_ent_N).sum()).backward()
    return lp_N, ent_N, hidden.grad, weight.grad


def check_against_reference(hidden_NH, weight_VH, targets_N, mask_N, temperature, grad_lp_N, grad_ent_N,
                            *, atol=2e-5, rtol=2e-5, grad_atol=1e-5, grad_rtol=1e-4):
    ref = run_logprob(linear_logprob_reference, hidden_NH.double(), weight_VH.double(), targets_N, mask_N,
                      temperature, grad_lp_N, grad_ent_N)
    out = run_logprob(linear_logprob, hidden_NH, weight_VH, targets_N, mask_N, temperature, grad_lp_N, grad_ent_N)
    assert out[0].dtype == torch.float32
    for name, a, e, at, rt in zip(
        ("logprobs", "entropy", "grad_hidden", "grad_weight"), out, ref,
        (atol, atol, grad_atol, grad_atol), (rtol, rtol, grad_rtol, grad_rtol), strict=True,
    ):
        assert_close(a, e, at, rt, name)
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprob_matches_reference_at_odd_shape(temperature, vocab_chunking):
    inputs = make_logprob_inputs(37, 64, 1003)
    lp_N, ent_N, grad_h, _ = check_against_reference(*inputs[:4], temperature, *inputs[4:])
    mask_N = inputs[3]
    assert (lp_N[~mask_N] == 0).all() and (ent_N[~mask_N] == 0).all()
    assert (grad_h[~mask_N] == 0).all()
    assert (lp_N[mask_N] < 0).all() and (ent_N[mask_N] > 0).all()


def test_chunked_logprob_matches_reference_at_smollm2_shape():
    # H = 576, V = 49152 (SmolLM2-135M's head); the vocabulary spans several chunks, the last one partial.
    num_tokens = 300
    num_chunks = -(-49152 // cpu_vocab_chunk(num_tokens, 49152))
    assert num_chunks >= 3 and 49152 % cpu_vocab_chunk(num_tokens, 49152) != 0
    inputs = make_logprob_inputs(num_tokens, 576, 49152, seed=1)
    check_against_reference(*inputs[:4], 1.0, *inputs[4:])


def test_logprob_without_mask_and_without_entropy_grad():
    hidden_NH, weight_VH, targets_N, _, grad_lp_N, _ = make_logprob_inputs(19, 32, 257, seed=2)
    zeros_N = torch.zeros_like(grad_lp_N)
    check_against_reference(hidden_NH, weight_VH, targets_N, None, 1.3, grad_lp_N, zeros_N)
    lp_only = linear_logprob(hidden_NH, weight_VH, targets_N)
    assert lp_only.shape == (19,)
    assert_close(lp_only, linear_logprob_reference(hidden_NH.double(), weight_VH.double(), targets_N), 2e-5, 2e-5, "lp")


def test_extreme_logits_stay_finite_and_exact(vocab_chunking):
    # Logits of order +-1e4: exp overflows without the running max, and lse - E[z] cancels to garbage
    # in float32 without the shifted entropy sums.
    inputs = make_logprob_inputs(23, 64, 1003, seed=3, scale=3e3)
    lp_N, ent_N, _, _ = check_against_reference(*inputs[:4], 1.0, *inputs[4:], atol=2e-3, rtol=1e-6, grad_rtol=1e-4)
    assert (lp_N[inputs[3]] < -1).any(), "the test should reach -inf-like log-probs"


def test_all_masked_batch_gives_zeros_and_zero_gradients():
    hidden_NH, weight_VH, targets_N, _, _, _ = make_logprob_inputs(8, 16, 50)
    hidden = hidden_NH.clone().requires_grad_()
    weight = weight_VH.clone().requires_grad_()
    mask_N = torch.zeros(8, dtype=torch.bool)
    targets_N[:] = -100  # padding ids at masked positions must not be read
    lp_N, ent_N = linear_logprob(hidden, weight, targets_N, mask_N, return_entropy=True)
    assert (lp_N == 0).all() and (ent_N == 0).all()
    (lp_N.sum() + ent_N.sum()).backward()
    assert (hidden.grad == 0).all() and (weight.grad == 0).all()


def test_single_token_batch():
    inputs = make_logprob_inputs(1, 64, 1003, seed=4)
    mask_N = torch.ones(1, dtype=torch.bool)
    check_against_reference(inputs[0], inputs[1], inputs[2], mask_N, 1.0, *inputs[4:])


def test_bf16_inputs_match_reference_on_the_same_rounded_values():
    inputs = make_logprob_inputs(37, 64, 1003, seed=5, dtype=torch.bfloat16)
    ref = run_logprob(linear_logprob_reference, inputs[0].double(), inputs[1].double(), *inputs[2:4], 1.0, *inputs[4:])
    out = run_logprob(linear_logprob, *inputs[:4], 1.0, *inputs[4:])
    assert out[0].dtype == torch.float32 and out[2].dtype == torch.bfloat16 and out[3].dtype == torch.bfloat16
    assert_close(out[0], ref[0], 2e-5, 2e-5, "logprobs")  # logits are formed in float32
    assert_close(out[2], ref[2], 0, 2e-2, "grad_hidden")  # bf16 gradients: 8 mantissa bits
    assert_close(out[3], ref[3], 0, 2e-2, "grad_weight")


def test_tied_embedding_weight_gets_both_gradients():
    # The LM head is the embedding matrix: the weight's gradient is the embedding's plus the head's.
    torch.manual_seed(6)
    vocab_size, hidden_size, num_tokens = 97, 24, 29
    tokens_N = torch.randint(0, vocab_size, (num_tokens + 1,))
    mask_N = torch.rand(num_tokens) > 0.2
    grads = []
    for fn in (linear_logprob, linear_logprob_reference):
        embedding = torch.nn.Embedding(vocab_size, hidden_size, dtype=torch.float64)
        embedding.weight.data = torch.randn(vocab_size, hidden_size, generator=torch.Generator().manual_seed(7),
                                            dtype=torch.float64)
        hidden_NH = torch.tanh(embedding(tokens_N[:-1]))
        fn(hidden_NH, embedding.weight, tokens_N[1:], mask_N).sum().backward()
        grads.append(embedding.weight.grad)
    assert_close(grads[0], grads[1], 1e-10, 1e-10, "tied weight grad")


def test_logprob_rejects_bad_input_with_clear_errors():
    hidden_NH, weight_VH, targets_N, mask_N, _, _ = make_logprob_inputs(5, 8, 11)
    with pytest.raises(ValueError, match=r"unmasked targets must lie in \[0, V=11\)"):
        linear_logprob(hidden_NH, weight_VH, torch.full((5,), 11))
    with pytest.raises(TypeError, match="share a dtype"):
        linear_logprob(hidden_NH, weight_VH.double(), targets_N)
    with pytest.raises(TypeError, match="targets must be int64"):
        linear_logprob(hidden_NH, weight_VH, targets_N.int())
    with pytest.raises(TypeError, match="mask must be bool"):
        linear_logprob(hidden_NH, weight_VH, targets_N, mask_N.float())
    with pytest.raises(ValueError, match="weight must be"):
        linear_logprob(hidden_NH, weight_VH[:, :4], targets_N)
    with pytest.raises(ValueError, match="temperature"):
        linear_logprob(hidden_NH, weight_VH, targets_N, temperature=0.0)


# ----------------------------------------------------------------------------- policy loss


def make_loss_inputs(num_tokens=37, num_seqs=5, *, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    seq_ids_N = torch.sort(torch.randint(0, num_seqs, (num_tokens,), generator=gen)).values
    logprobs_N = -torch.rand(num_tokens, generator=gen, dtype=torch.float64) * 3
    # Spread the ratio over ~[0.5, 2] so both clips and the IS cap are exercised.
    proximal_N = logprobs_N + 0.4 * torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    behavior_N = proximal_N + 0.6 * torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    advantages_N = torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    ref_N = proximal_N + 0.3 * torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    entropy_N = torch.rand(num_tokens, generator=gen, dtype=torch.float64) * 2
    mask_N = torch.rand(num_tokens, generator=gen) > 0.25
    floats = [t.to(dtype) for t in (logprobs_N, proximal_N, behavior_N, advantages_N, ref_N, entropy_N)]
    return floats, mask_N, seq_ids_N


CONFIGS = [
    PolicyLossConfig(),
    PolicyLossConfig(agg="seq_mean", kl_coef=0.05, entropy_coef=0.01),
    PolicyLossConfig(agg="constant", constant_normaliser=64.0, is_cap=None),
    PolicyLossConfig(ratio_level="sequence", eps_low=3e-2, eps_high=4e-2, agg="seq_mean", entropy_coef=0.02),
    PolicyLossConfig(ratio_level="sequence", agg="token_mean", kl_coef=0.1, is_cap=math.inf),
    PolicyLossConfig(eps_low=0.1, eps_high=0.1, is_cap=1.2, kl_coef=0.2, entropy_coef=0.05, agg="constant",
                     constant_normaliser=10.0),
    # Dual clip: at these inputs c = 1.5 caps 4 of the 29 masked tokens, the GSPO case (1.3) 7 (the
    # default c = 3 in the configs above caps none); and one config with it off.
    PolicyLossConfig(clip_ratio_c=1.5, kl_coef=0.05),
    PolicyLossConfig(ratio_level="sequence", eps_low=3e-2, eps_high=4e-2, clip_ratio_c=1.3, agg="seq_mean",
                     is_cap=None),
    PolicyLossConfig(clip_ratio_c=None, kl_coef=0.05, entropy_coef=0.01),
]
DUAL_CLIP_ACTIVE = (1.5, 1.3)


def config_id(config: PolicyLossConfig) -> str:
    return f"{config.ratio_level}-{config.agg}-kl{config.kl_coef}-is{config.is_cap}-c{config.clip_ratio_c}"


def run_loss(fn, floats, mask_N, seq_ids_N, num_seqs, config):
    logprobs_N, proximal_N, behavior_N, advantages_N, ref_N, entropy_N = (t.clone() for t in floats)
    logprobs_N.requires_grad_()
    entropy_N.requires_grad_()
    loss, stats = fn(logprobs_N, proximal_N, None if config.is_cap is None else behavior_N, advantages_N,
                     mask_N, seq_ids_N, num_seqs=num_seqs, config=config, ref_logprobs=ref_N, entropy=entropy_N)
    grad_lp_N, grad_ent_N = torch.autograd.grad(loss, (logprobs_N, entropy_N))
    return loss, stats, grad_lp_N, grad_ent_N


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_policy_loss_matches_reference(config):
    floats, mask_N, seq_ids_N = make_loss_inputs()
    ref = run_loss(policy_loss_reference, [t.double() for t in floats], mask_N, seq_ids_N, 5, config)
    out = run_loss(policy_loss, floats, mask_N, seq_ids_N, 5, config)
    assert out[0].dtype == torch.float32
    assert_close(out[0], ref[0], 1e-6, 1e-5, "loss")
    assert_close(out[2], ref[2], 1e-7, 1e-5, "grad logprobs")
    assert_close(out[3], ref[3], 1e-7, 1e-5, "grad entropy")
    assert sorted(out[1]) == sorted(ref[1])
    for name in ref[1]:
        assert_close(out[1][name], ref[1][name], 1e-6, 1e-5, name)
    assert (out[2][~mask_N] == 0).all()
    if config.ratio_level == "token":
        # The chosen inputs must exercise every branch, or the comparison proves little.
        assert ref[1]["clip_frac_low"] > 0 and ref[1]["clip_frac_high"] > 0
        assert config.is_cap in (None, math.inf) or ref[1]["is_trunc_frac"] > 0
    assert config.clip_ratio_c not in DUAL_CLIP_ACTIVE or ref[1]["dual_clip_frac"] > 0
    assert ("dual_clip_frac" in ref[1]) == (config.clip_ratio_c is not None)


def test_policy_loss_clip_semantics_by_hand():
    # Four tokens, one sequence, token_mean, no IS weight: ratios 1.5 (A>0), 0.5 (A<0), 1.1 (A>0), 0.5 (A>0).
    ratio_N = torch.tensor([1.5, 0.5, 1.1, 0.5], dtype=torch.float64)
    adv_N = torch.tensor([1.0, -1.0, 2.0, 1.0], dtype=torch.float64)
    prox_N = torch.full((4,), -1.0, dtype=torch.float64)
    logprobs_N = (prox_N + ratio_N.log()).requires_grad_()
    config = PolicyLossConfig(eps_low=0.2, eps_high=0.28, is_cap=None)
    loss, stats = policy_loss(logprobs_N, prox_N, None, adv_N, torch.ones(4, dtype=torch.bool),
                              torch.zeros(4, dtype=torch.int64), num_seqs=1, config=config)
    loss.backward()
    # Clipped: 1.5 -> 1.28 (A>0, no gradient), 0.5 -> 0.8 (A<0, no gradient); unclipped: 1.1, and 0.5 with A>0.
    expected_loss = -(1.28 * 1 + 0.8 * -1 + 1.1 * 2 + 0.5 * 1) / 4
    assert loss.item() == pytest.approx(expected_loss, abs=1e-12)
    assert logprobs_N.grad.tolist() == pytest.approx([0.0, 0.0, -1.1 * 2 / 4, -0.5 * 1 / 4], abs=1e-12)
    assert stats["clip_frac_high"].item() == pytest.approx(0.25)
    assert stats["clip_frac_low"].item() == pytest.approx(0.25)
    assert stats["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.1 + 0.5) / 4)
    assert stats["num_tokens"].item() == 4


def test_importance_weight_is_truncated_at_cap():
    prox_N = torch.tensor([-1.0, -1.0], dtype=torch.float64)
    behavior_N = torch.tensor([-1.0 - math.log(3.0), -1.0 + math.log(2.0)], dtype=torch.float64)  # w = 3, 0.5
    logprobs_N = prox_N.clone().requires_grad_()
    loss, stats = policy_loss(logprobs_N, prox_N, behavior_N, torch.ones(2, dtype=torch.float64),
                              torch.ones(2, dtype=torch.bool), torch.tensor([0, 1]), num_seqs=2,
                              config=PolicyLossConfig(is_cap=2.0))
    loss.backward()
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    assert logprobs_N.grad.tolist() == pytest.approx([-1.0, -0.25])
    assert stats["is_trunc_frac"].item() == pytest.approx(0.5)


# A hand-computed dual-clip case: one sequence, token_mean, no IS weight, eps 0.2 / 0.28, c = 3.
# (ratio, advantage) -> per-token loss and d loss / d logp (times N = 5) with and without the dual clip:
#   (4.0, -1): max(4, 1.28) = 4 -> capped at 3, gradient 0  | without: 4, gradient -A r = 4
#   (2.0, -1): 2 < 3, unclipped, gradient 2                  | the same
#   (4.0, +1): upper clip, -1.28, gradient 0 (A > 0: never dual-clipped)
#   (0.5, -2): lower clip, -A 0.8 = 1.6, gradient 0
#   (10., -2): 20 -> capped at 6, gradient 0                 | without: 20, gradient 20
DUAL_CLIP_RATIOS = (4.0, 2.0, 4.0, 0.5, 10.0)
DUAL_CLIP_ADVANTAGES = (-1.0, -1.0, 1.0, -2.0, -2.0)
DUAL_CLIP_EXPECTED = {
    3.0: {"loss": (3 + 2 - 1.28 + 1.6 + 6) / 5, "grad": [0.0, 2 / 5, 0.0, 0.0, 0.0], "dual_clip_frac": 2 / 5},
    None: {"loss": (4 + 2 - 1.28 + 1.6 + 20) / 5, "grad": [4 / 5, 2 / 5, 0.0, 0.0, 20 / 5]},
}


def dual_clip_by_hand(fn, clip_ratio_c: float | None, dtype=torch.float64):
    """(loss, stats, grad) of `fn` on the case above; the log-ratios are formed in float64, then cast."""
    prox_N = torch.full((5,), -1.0, dtype=torch.float64)
    logprobs_N = (prox_N + torch.tensor(DUAL_CLIP_RATIOS, dtype=torch.float64).log()).to(dtype).requires_grad_()
    config = PolicyLossConfig(eps_low=0.2, eps_high=0.28, is_cap=None, clip_ratio_c=clip_ratio_c)
    loss, stats = fn(logprobs_N, prox_N.to(dtype), None, torch.tensor(DUAL_CLIP_ADVANTAGES, dtype=dtype),
                     torch.ones(5, dtype=torch.bool), torch.zeros(5, dtype=torch.int64), num_seqs=1, config=config)
    (grad_N,) = torch.autograd.grad(loss, logprobs_N)
    return loss, stats, grad_N


@pytest.mark.parametrize("clip_ratio_c", [3.0, None])
@pytest.mark.parametrize("fn", [policy_loss, policy_loss_reference], ids=["fused", "reference"])
def test_dual_clip_by_hand(fn, clip_ratio_c):
    loss, stats, grad_N = dual_clip_by_hand(fn, clip_ratio_c)
    expected = DUAL_CLIP_EXPECTED[clip_ratio_c]
    assert loss.item() == pytest.approx(expected["loss"], abs=1e-12)
    assert grad_N.tolist() == pytest.approx(expected["grad"], abs=1e-12)
    assert stats["clip_frac_low"].item() == pytest.approx(1 / 5) and stats["clip_frac_high"].item() == pytest.approx(1 / 5)
    if clip_ratio_c is None:
        assert "dual_clip_frac" not in stats
    else:
        assert stats["dual_clip_frac"].item() == pytest.approx(expected["dual_clip_frac"])


def test_dual_clip_float32_and_infinite_bound():
    # float32 through the fused path: within float32 rounding of the hand values.
    loss, stats, grad_N = dual_clip_by_hand(policy_loss, 3.0, dtype=torch.float32)
    assert loss.item() == pytest.approx(DUAL_CLIP_EXPECTED[3.0]["loss"], rel=1e-6)
    assert grad_N.tolist() == pytest.approx(DUAL_CLIP_EXPECTED[3.0]["grad"], rel=1e-6, abs=1e-7)
    # c = inf (how a TOML file turns the dual clip off) is exactly c = None, zero advantages included.
    floats, mask_N, seq_ids_N = make_loss_inputs(seed=3)
    floats[3][::4] = 0.0
    for fn in (policy_loss, policy_loss_reference):
        off = run_loss(fn, floats, mask_N, seq_ids_N, 5, PolicyLossConfig(kl_coef=0.05, clip_ratio_c=None))
        inf = run_loss(fn, floats, mask_N, seq_ids_N, 5, PolicyLossConfig(kl_coef=0.05, clip_ratio_c=math.inf))
        assert inf[0].item() == off[0].item() and torch.equal(inf[2], off[2]) and torch.equal(inf[3], off[3])
        assert inf[1].keys() == off[1].keys() and "dual_clip_frac" not in inf[1]
    for fn in (policy_loss, policy_loss_reference):
        loss, stats, grad_N = dual_clip_by_hand(fn, math.inf)
        assert loss.item() == pytest.approx(DUAL_CLIP_EXPECTED[None]["loss"], abs=1e-12)
        assert grad_N.tolist() == pytest.approx(DUAL_CLIP_EXPECTED[None]["grad"], abs=1e-12)


def kl_gap_inputs(gap: float, dtype: torch.dtype):
    """make_loss_inputs with the reference `gap` nats above the policy at every 3rd token and `gap` below
    it at every 3rd token + 1 (N = 37: both clamp sides, masked and unmasked), in `dtype`."""
    floats, mask_N, seq_ids_N = make_loss_inputs(seed=7, dtype=torch.float64)
    logprobs_N, ref_N = floats[0], floats[4]
    ref_N[0::3] = logprobs_N[0::3] + gap
    ref_N[1::3] = logprobs_N[1::3] - gap
    return [t.to(dtype) for t in floats], mask_N, seq_ids_N


KL_GAP_CONFIGS = [
    PolicyLossConfig(kl_coef=0.1, clip_ratio_c=None),
    PolicyLossConfig(ratio_level="sequence", agg="seq_mean", kl_coef=0.05, clip_ratio_c=3.0, entropy_coef=0.01),
]
# float32: as in test_policy_loss_matches_reference; bf16 returns the loss and the gradient in bf16
# (8 mantissa bits: 4e-3 relative rounding), computed in float32 from the same rounded inputs.
KL_GAP_TOLERANCES = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-6, 1e-2)}


def kl_gap_case(fn, gap: float, dtype: torch.dtype, config: PolicyLossConfig):
    floats, mask_N, seq_ids_N = kl_gap_inputs(gap, dtype)
    ref = run_loss(policy_loss_reference, [t.double() for t in floats], mask_N, seq_ids_N, 5, config)
    out = run_loss(fn, floats, mask_N, seq_ids_N, 5, config)
    return ref, out, mask_N


@pytest.mark.parametrize("config", KL_GAP_CONFIGS, ids=config_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gap", [100.0, 1000.0])
def test_kl_is_finite_and_exact_at_large_log_ratio_gaps(gap, dtype, config):
    # exp(ref - logp) overflows float32 from a gap of 88.7 nats and float64 from 709.8 without the clamp.
    ref, out, mask_N = kl_gap_case(policy_loss, gap, dtype, config)
    atol, rtol = KL_GAP_TOLERANCES[dtype]
    for name, i in (("loss", 0), ("grad logprobs", 2), ("grad entropy", 3)):
        assert_close(ref[i], ref[i], 0, 0, f"reference {name}")  # finite
        assert_close(out[i], ref[i], atol, rtol, name)
    for name in ref[1]:
        assert_close(out[1][name], ref[1][name], atol, 1e-5, name)
    # Where the clamp acts, the KL's value is the bound's and its gradient is zero: the gradient there is
    # the policy-gradient term's alone, bit for bit.
    clamped_N = torch.zeros(37, dtype=torch.bool)
    clamped_N[0::3] = clamped_N[1::3] = True
    clamped_N &= mask_N
    num_up, num_down = mask_N[0::3].sum().item(), mask_N[1::3].sum().item()
    kl_at_bounds = (math.exp(20) - 21) * num_up + (math.exp(-20) + 19) * num_down
    assert kl_at_bounds <= ref[1]["kl"].item() * mask_N.sum().item() < kl_at_bounds * (1 + 1e-6)
    floats, _, seq_ids_N = kl_gap_inputs(gap, dtype)
    no_kl = run_loss(policy_loss, floats, mask_N, seq_ids_N, 5, dataclasses.replace(config, kl_coef=0.0))
    assert torch.equal(out[2][clamped_N], no_kl[2][clamped_N])


def test_kl_clamp_by_hand():
    # Three tokens, advantage 0 (no policy-gradient term), kl_coef 1, token_mean: gaps ref - logp of
    # +100, -100 and 0.5 nats. k3 at the bound: exp(20) - 21 and exp(-20) + 19, gradient 0.
    gaps = (100.0, -100.0, 0.5)
    expected_loss = ((math.exp(20) - 21) + (math.exp(-20) + 19) + (math.exp(0.5) - 1.5)) / 3
    expected_grad = [0.0, 0.0, (1 - math.exp(0.5)) / 3]
    for fn, dtype, rel in ((policy_loss_reference, torch.float64, 1e-12), (policy_loss, torch.float64, 1e-12),
                           (policy_loss, torch.float32, 1e-6)):
        logprobs_N = torch.full((3,), -2.0, dtype=dtype, requires_grad=True)
        ref_N = (logprobs_N.detach().double() + torch.tensor(gaps, dtype=torch.float64)).to(dtype)
        loss, stats = fn(logprobs_N, logprobs_N.detach(), None, torch.zeros(3, dtype=dtype), torch.ones(3, dtype=torch.bool),
                         torch.zeros(3, dtype=torch.int64), num_seqs=1,
                         config=PolicyLossConfig(is_cap=None, kl_coef=1.0), ref_logprobs=ref_N)
        (grad_N,) = torch.autograd.grad(loss, logprobs_N)
        assert loss.item() == pytest.approx(expected_loss, rel=rel), (fn.__name__, dtype)
        assert stats["kl"].item() == pytest.approx(expected_loss, rel=rel)
        assert grad_N.tolist() == pytest.approx(expected_grad, rel=rel, abs=1e-12), (fn.__name__, dtype)


def test_policy_loss_all_masked_and_padding_values():
    floats, _, seq_ids_N = make_loss_inputs(seed=1)
    floats[1][:] = -math.inf  # masked positions may hold anything
    floats[2][:] = math.nan
    mask_N = torch.zeros(37, dtype=torch.bool)
    for config in CONFIGS:
        loss, stats, grad_lp_N, grad_ent_N = run_loss(policy_loss, floats, mask_N, seq_ids_N, 5, config)
        assert loss.item() == 0 and (grad_lp_N == 0).all() and (grad_ent_N == 0).all()
        assert stats["num_tokens"].item() == 0
        assert all(torch.isfinite(v) for v in stats.values())


def test_single_token_sequences_gspo_equals_token_level():
    # With one token per sequence the sequence-level ratio is the token ratio.
    floats, mask_N, _ = make_loss_inputs(seed=2)
    seq_ids_N = torch.arange(37)
    token = run_loss(policy_loss, floats, mask_N, seq_ids_N, 37, PolicyLossConfig(agg="seq_mean"))
    seq = run_loss(policy_loss, floats, mask_N, seq_ids_N, 37, PolicyLossConfig(agg="seq_mean", ratio_level="sequence"))
    assert_close(seq[0], token[0], 1e-7, 1e-6, "loss")
    assert_close(seq[2], token[2], 1e-7, 1e-6, "grad")


def test_policy_loss_config_and_input_validation():
    with pytest.raises(ValueError, match="constant_normaliser"):
        PolicyLossConfig(agg="constant")
    with pytest.raises(ValueError, match="ratio_level"):
        PolicyLossConfig(ratio_level="tokens")
    with pytest.raises(ValueError, match="eps_low"):
        PolicyLossConfig(eps_low=1.0)
    for bad in (1.0, 0.5, -3.0, math.nan, True):
        with pytest.raises(ValueError, match="clip_ratio_c must be a float > 1"):
            PolicyLossConfig(clip_ratio_c=bad)
    assert PolicyLossConfig().clip_ratio_c == 3.0 and PolicyLossConfig(clip_ratio_c=3).dual_clip_bound == 3.0
    assert PolicyLossConfig(clip_ratio_c=None).dual_clip_bound == math.inf
    floats, mask_N, seq_ids_N = make_loss_inputs()
    lp, prox, behav, adv, ref, ent = floats
    kwargs = dict(num_seqs=5, config=PolicyLossConfig())
    with pytest.raises(ValueError, match="behavior_logprobs is required"):
        policy_loss(lp, prox, None, adv, mask_N, seq_ids_N, **kwargs)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(lp, prox, behav, adv, mask_N, seq_ids_N, num_seqs=5, config=PolicyLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="needs entropy"):
        policy_loss(lp, prox, behav, adv, mask_N, seq_ids_N, num_seqs=5, config=PolicyLossConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match="seq_ids must lie in"):
        policy_loss(lp, prox, behav, adv, mask_N, seq_ids_N, num_seqs=2, config=PolicyLossConfig())
    with pytest.raises(ValueError, match="advantages must have shape"):
        policy_loss(lp, prox, behav, adv[:-1], mask_N, seq_ids_N, **kwargs)
    with pytest.raises(TypeError, match="mask must be torch.bool"):
        policy_loss(lp, prox, behav, adv, mask_N.long(), seq_ids_N, **kwargs)


def test_kernel_modules_import_no_cycle():
    # Layout: the loss's config lives in policy_loss_config (no torch) and the inputs' validation in
    # policy_loss_inputs, which the fused path and the reference import; the Triton modules import nothing from the package (their launchers take scalars).
    # Every import counts, the lazy ones inside functions included.
    kernels_dir = Path(importlib.import_module("agentrl.kernels.policy_loss_config").__file__).parent
    imports: dict[str, set[str]] = {}
    for path in kernels_dir.glob("*.py"):
        tree = ast.parse(path.read_text())
        found = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        found |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imports[path.stem] = {m.removeprefix("agentrl.kernels.") for m in found if m.startswith("agentrl.kernels.")}
    assert imports["triton_policy_loss"] == set() and imports["triton_linear_logprob"] == set()
    assert imports["policy_loss_config"] == set() and imports["policy_loss_inputs"] == {"policy_loss_config"}

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        return any(m == target or (m not in seen and reaches(m, target, seen | {m})) for m in imports.get(start, ()))

    cycles = sorted(name for name in imports if name != "__init__" and reaches(name, name, {name}))
    assert not cycles, f"modules on an import cycle: {cycles} ({imports})"


# ----------------------------------------------------------------------------- convergence


class TinyPolicy(torch.nn.Module):
    """Embedding -> one residual MLP block -> tied LM head: enough to move log-probs under Adam."""

    def __init__(self, vocab_size: int, hidden_size: int, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Parameter(torch.randn(vocab_size, hidden_size, generator=gen) * 0.5)
        self.mlp = torch.nn.Parameter(torch.randn(hidden_size, hidden_size, generator=gen) / hidden_size**0.5)

    def hidden(self, tokens_N: torch.Tensor) -> torch.Tensor:
        x_NH = self.embed[tokens_N]
        return x_NH + torch.tanh(x_NH @ self.mlp)


def train_losses(logprob_fn, loss_fn, num_steps: int = 6) -> list[float]:
    vocab_size, hidden_size, num_tokens, num_seqs = 211, 32, 48, 6
    gen = torch.Generator().manual_seed(11)
    tokens_N = torch.randint(0, vocab_size, (num_tokens + 1,), generator=gen)
    seq_ids_N = torch.arange(num_tokens) // (num_tokens // num_seqs)
    mask_N = torch.rand(num_tokens, generator=gen) > 0.3
    advantages_N = torch.randn(num_seqs, generator=gen)[seq_ids_N]
    behavior_N = -3 - torch.rand(num_tokens, generator=gen)
    model = TinyPolicy(vocab_size, hidden_size, seed=12)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    config = PolicyLossConfig(agg="seq_mean", kl_coef=0.05, entropy_coef=0.01)
    losses = []
    with torch.no_grad():
        ref_N = logprob_fn(model.hidden(tokens_N[:-1]), model.embed, tokens_N[1:], mask_N)
    for _ in range(num_steps):
        with torch.no_grad():  # the proximal policy: the weights before this step
            proximal_N = logprob_fn(model.hidden(tokens_N[:-1]), model.embed, tokens_N[1:], mask_N)
        for _ in range(2):  # two minibatch passes per step so the ratio leaves 1 and the clip acts
            lp_N, ent_N = logprob_fn(model.hidden(tokens_N[:-1]), model.embed, tokens_N[1:], mask_N, 1.0, True)
            loss, _ = loss_fn(lp_N, proximal_N, behavior_N, advantages_N, mask_N, seq_ids_N, num_seqs=num_seqs,
                              config=config, ref_logprobs=ref_N, entropy=ent_N)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def test_tiny_model_training_matches_reference():
    fused = train_losses(linear_logprob, policy_loss)
    ref = train_losses(linear_logprob_reference, policy_loss_reference)
    assert fused == pytest.approx(ref, rel=1e-4, abs=1e-5)
    assert abs(fused[-1] - fused[0]) > 1e-2, "the model should move over the steps"
