"""agentrl.learner: consumes trajectory groups, trains the policy, publishes weights and versions.

Modules: `advantages` (estimators, reward weights, dynamic sampling), `batching` (packing, the packed
policy forward with the fused log-prob kernel), `trainer` (decoupled-PPO and SFT optimizer steps),
`ledger` (spool, consumption ledger, atomic checkpoints: exactly-once across kill -9), `publish`
(weight snapshots pushed to vLLM in the background), `metrics` (JSONL, TensorBoard, progress bar),
`service` (the `agentrl learner --config FILE` process and its `LearnerConfig`), `distributed`
(FSDP2 data parallel), `synthetic` (valid trajectories and a tiny model for tests and benchmarks).
"""
