"""agentrl.kernels"""
