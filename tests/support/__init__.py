"""Helpers for the tests (and benchmarks): valid synthetic trajectories, a tiny model, the FSDP check."""
