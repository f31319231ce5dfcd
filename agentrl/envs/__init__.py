"""agentrl.envs: environment packages that ship with agentrl, each one environment with its tasks,
loaders, metrics and summary keys, plugged in the way a user's own environment is (by name in a
config; the engine imports none of them).

    multihop_qa/  multi-hop question answering with a search tool (the embedded default's job)

Import rule: imports agentrl.common, agentrl.engine and agentrl.toolservers; never agentrl.learner,
agentrl.kernels, agentrl.gateway or the applications at the package root.
"""
