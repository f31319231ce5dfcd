"""The phases of `agentrl train`, each a function of the run's `Supervisor` (agentrl/train.py):

- baseline.py: the untrained policy's held-out evaluation and the environment's baselines, or their
  cached results (agentrl/evalcache.py);
- sft.py: the SFT cold start (demonstrations streamed to a learner process) and the demonstration
  anchor's spool;
- rl.py: the learner and the actor side by side, the services kept alive (agentrl/launch/keeper.py),
  evaluations every `eval.every_s`, a learner that dies started again;
- evaluations.py: every held-out evaluation of the run (logged, written per task, reused when the
  served weights are the ones an earlier evaluation measured).

The supervisor owns the state they share (the budget's deadline, the services, the launcher, the
credentials); the time-budget rules are agentrl/budget.py, the child processes' configs
agentrl/launch/children.py, the summary and the report agentrl/summary.py.
"""
