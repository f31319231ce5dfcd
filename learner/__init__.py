"""agentrl.learner"""
