"""agentrl.toolservers"""
