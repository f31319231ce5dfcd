"""agentrl.learner: consumes trajectory groups, trains the policy, publishes weights and versions.

    service.py       the `agentrl learner` process: wiring and the step loop; config.py its LearnerConfig
    intake.py        receiver + spool + ledger (exactly-once consumption; ledger.py)
    rejected.py      rejected/: refused group messages (raw frames + JSON reason), kept for reading
    prepare.py       batch preparation (staleness, filtering, advantages): a pure function
    ranks.py         build / restore / step / snapshot / checkpoint state, in one process or as rank 0
                     under torchrun (distributed.py: FSDP2, the rank command channel)
    rewards.py       reward weighting and the schedule; advantages.py the estimators
    batching.py      packing and the packed policy forward; trainer.py the optimizer steps
    checkpoint.py    atomic checkpoint I/O; publish.py background weight pushes; metrics.py JSONL + TensorBoard

Import rule: imports agentrl.common (trajectory, transport, inference client, weight push, config)
and agentrl.kernels; never agentrl.engine (the orchestrator's package), agentrl.toolservers or the
applications at the package root.
"""
