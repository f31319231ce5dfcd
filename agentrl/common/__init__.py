"""agentrl.common: what the actor side and the learner both use, owned by neither.

    trajectory.py  the Trajectory / TrajectoryGroup record and its wire format
    transport.py   trajectory groups orchestrator -> learner (acked), versions learner -> orchestrator
    curve.py       CurveZMQ for the sockets that bind (learner, tool services): the loopback rule, keys
    inference.py   the token-in/token-out vLLM client
    weights.py     the weight push (stage, pause(keep), reload, resume) and cache reset
    vllm_ext.py    the worker extension inside vLLM that receives pushes (loaded by the server)
    procs.py       child processes owned by PID (start in a process group, bounded stop)
    config.py      the typed-config system: TOML layers, --set, validation, errors, TOML writer
    model.py       the embedded default model (prepared from the shipped GGUF) and model folders

Import rule: modules here import only the standard library, third-party packages and each other;
never agentrl.engine, agentrl.learner, agentrl.toolservers, agentrl.kernels or the supervisor.
"""
