"""agentrl.kernels: fused log-prob and policy-loss kernels, with their references.

Public entry points (each picks the Triton kernels on CUDA and the torch path elsewhere):
- `linear_logprob(hidden, weight, targets, mask=None, temperature=1.0, return_entropy=False)`
- `policy_loss(logprobs, proximal_logprobs, behavior_logprobs, advantages, mask, seq_ids, *,
  num_seqs, config, ref_logprobs=None, entropy=None)` with `PolicyLossConfig`

The Triton modules are imported only when a CUDA tensor (or a test) asks for them.

Import rule: imports only agentrl.common (the config decorator of `PolicyLossConfig`).
"""

from agentrl.kernels.linear_logprob import linear_logprob, linear_logprob_with_backend
from agentrl.kernels.policy_loss import PolicyLossConfig, policy_loss, policy_loss_with_backend
from agentrl.kernels.reference import linear_logprob_reference, policy_loss_reference

__all__ = [
    "linear_logprob",
    "linear_logprob_with_backend",
    "PolicyLossConfig",
    "policy_loss",
    "policy_loss_with_backend",
    "linear_logprob_reference",
    "policy_loss_reference",
]
