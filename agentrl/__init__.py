"""agentrl: an asynchronous actor-learner engine for agentic RL."""

__version__ = "0.1.0"
