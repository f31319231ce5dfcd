"""agentrl.engine: the actor side, shared by every environment. Episodes, the environment base class,
tools, tasks, the orchestrator, and the wiring that `agentrl train`, `eval` and `rollout` share.
Environments themselves (the multi-hop QA one included) live outside it: agentrl/envs, examples/.

    env.py           ToolEnv: the agent MDP (parse actions, call tools, observations, rewards, termination)
    task.py          Task: what one episode is about (environments interpret it)
    episode.py       run_episode (one episode's loop), gold trajectories for SFT
    demonstrations.py  the SFT cold start's demonstrations (a recorded JSONL, or the environment's own)
    environments.py  the environment a config names, built for a run; plugins.py "module:name" plug-ins
    chat.py          ChatML as token ids, the system prompt; parsers.py tool-call formats
    tools.py         Tool / ToolResult, FunctionTool, RemoteTool (a ZeroMQ tool service's tools)
    mcp.py           MCP servers as tools; tool_cli.py `agentrl tool call|describe`
    agent.py         `[agent]`: an outside agent program trained through the gateway
    rewards.py       process reward term names and raw values (weighting is the learner's)
    tasksets.py      the task loader registry (train stream, held-out set, corpus), JSONL and datasets loaders
    orchestrator.py  thousands of concurrent episodes, GRPO groups, staleness bound, backpressure
    pool.py          balancing over vLLM servers with failover; serve.py starts a vLLM server
    services.py      start the services a run needs, connect to them (Connections)
    evaluation.py    held-out evaluation and the environment's baselines; actor.py the `agentrl actor` process

Import rule: imports agentrl.common and agentrl.toolservers (clients, the service launcher);
never agentrl.learner, agentrl.kernels or the applications at the package root.
"""
