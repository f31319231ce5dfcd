"""agentrl.kernels: fused log-prob and policy-loss kernels, with their references.

Public entry points (each picks the Triton kernels on CUDA and the torch path elsewhere):
- `agentrl.kernels.linear_logprob.linear_logprob(hidden, weight, targets, mask=None, temperature=1.0,
  return_entropy=False)` (and `linear_logprob_with_backend`)
- `agentrl.kernels.policy_loss.policy_loss(logprobs, proximal_logprobs, behavior_logprobs, advantages,
  mask, seq_ids, *, num_seqs, config, ref_logprobs=None, entropy=None)` (and
  `policy_loss_with_backend`), with `agentrl.kernels.policy_loss_config.PolicyLossConfig`
- the materialising references: `agentrl.kernels.reference.linear_logprob_reference`,
  `policy_loss_reference`

The Triton modules are imported only when a CUDA tensor (or a test) asks for them.

Import rule: imports only agentrl.common (the config decorator of `PolicyLossConfig`). This file imports
nothing: `policy_loss_config`, which a run's config reads, comes without torch, and the entry points
are imported from their modules (a package-level name would be replaced by the submodule of the same
name once that is imported).
"""
