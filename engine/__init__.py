"""agentrl.engine"""
