"""The policy loss's config and its bounds: what every path of the loss shares. Plain data, no torch,
so that a run's config can be read without importing the training stack; the inputs' validation,
which needs torch, is `policy_loss_inputs.py`.

The fused path (`policy_loss.py`) and the plain-PyTorch reference (`reference.py`) import this
module; the Triton kernel (`triton_policy_loss.py`) imports nothing from the package and takes its
scalars as arguments, so no module of the loss imports another one's implementation.

Shape legend: N tokens (packed sequences), S sequences (`num_seqs`). The math is stated in
`agentrl.kernels.policy_loss`.
"""

from __future__ import annotations

import math
from typing import Literal

from agentrl.common.config import config_dataclass

# Both clamps keep exp() finite in float32 (and bf16): exp(20) = 4.9e8, while exp(x) overflows float32
# from x = 88.7. verl clamps its policy ratio's and its k3 KL's log-ratio at the same +-20.
log_ratio_clamp = 20.0
"""Bound on the policy log-ratio logp - prox (nats), token or sequence level."""
kl_log_ratio_clamp = 20.0
"""Bound on the k3 KL's log-ratio ref - logp (nats). Without it the k3 term exp(ref - logp) is inf
in float32 once the reference assigns a token 88.7 nats more than the policy does (a token the policy
has pushed to a -inf-like log-prob). Inside the bound the k3 term and its gradient are exact; outside
it they are those of the bound (kl_t <= exp(20) - 21 = 4.9e8 per token, kl_t -> 19 for the other
side) and the gradient is zero, as autograd of torch.clamp gives. The estimate itself is not clamped
(verl also clamps it at 10): that would zero the KL's gradient from ref - logp = 2.6 nats on, exactly
where the policy has moved furthest below the reference."""


@config_dataclass
class PolicyLossConfig:
    eps_low: float = 0.2
    """Lower clip: the ratio is clipped at 1 - eps_low (dimensionless, in [0, 1))."""
    eps_high: float = 0.28
    """Upper clip (DAPO clip-higher): the ratio is clipped at 1 + eps_high (dimensionless, >= 0)."""
    clip_ratio_c: float | None = 3.0
    """Dual clip (Ye et al. 2020, arXiv:1912.09729; verl's clip_ratio_c) for tokens with A < 0: the
    ratio's contribution is capped at c, pg_t = min(max(-A r, -A clip(r)), -A c), so pg_t = -A c with
    zero gradient where r > c. Dimensionless, > 1; None or math.inf (which a TOML file can spell)
    disables it. Default 3.0 (verl's): free where it cannot act (r = 1 exactly in the trainer as
    wired) and it halves the gradient norm of a batch whose log-ratio has drifted by 1 nat
    (docs/notes/learner-and-kernels.md, "KL clamp and dual clip")."""
    is_cap: float | None = 2.0
    """Truncation of the decoupled importance weight pi_prox / pi_behavior (TIS), dimensionless,
    > 0 (math.inf keeps the untruncated weight). None disables the weight (w = 1)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """"token" (PPO/GRPO) or "sequence" (GSPO: geometric mean of the ratio over a sequence's masked
    tokens)."""
    agg: Literal["token_mean", "seq_mean", "constant"] = "token_mean"
    """"token_mean" (DAPO), "seq_mean" (mean per sequence, then over sequences) or "constant"
    (Dr. GRPO: sum / constant_normaliser)."""
    constant_normaliser: float | None = None
    """Denominator for agg == "constant", in tokens (e.g. max response tokens x number of sequences)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference policy (per token, nats); needs ref_logprobs when > 0.
    Its log-ratio is clamped at +-kl_log_ratio_clamp (module docstring)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (nats), subtracted from the loss; needs entropy when > 0."""

    def __post_init__(self) -> None:
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        if self.clip_ratio_c is not None and (isinstance(self.clip_ratio_c, bool) or not self.clip_ratio_c > 1):
            raise ValueError(
                f"clip_ratio_c must be a float > 1 (verl defaults to 3.0), or None / math.inf to disable "
                f"the dual clip, got {self.clip_ratio_c!r}"
            )
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

    @property
    def dual_clip_bound(self) -> float:
        """c as the kernels take it: math.inf when the dual clip is off (None or math.inf)."""
        return math.inf if self.clip_ratio_c is None else float(self.clip_ratio_c)

    @property
    def dual_clip_on(self) -> bool:
        return self.dual_clip_bound < math.inf
