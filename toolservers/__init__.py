"""agentrl.toolservers: tool services over ZeroMQ, and the sandbox for untrusted code.

    protocol.py        wire format (msgpack maps or batches of them), error types, argument checking
    server.py          ToolServer: ROUTER loop, backpressure, bounded shutdown; Tool / ToolSpec
    client.py          ToolClient: async DEALER client over replicas, heartbeats, retries
    calculator.py      `calculator`: exact arithmetic, parsed safely
    search.py          `search`: BM25 (bm25s) over a JSONL passage corpus, cached index
    sandbox.py         `python`: bubblewrap sandboxes started ahead of time (pool); SandboxConfig
    sandbox_frames.py  the host side of the sandbox's frame protocol (length-prefixed JSON results)
    cgroups.py         the sandboxes' cgroups (v1): roots, CPU quota under the parents', cleanup
    sandbox_zygote.py  the program that runs inside each sandbox (never imported)
    functions.py       serve(): Python functions as a tool service (a user's own, `[[tools]] command`)
    process.py         start_toolserver(): run a service as a subprocess, wait for READY, stop by PID
    cli.py             `agentrl toolserver NAME ...`, `agentrl tool call|describe ...`

Import rule: imports only agentrl.common (child processes); never the engine, the learner or
the supervisor. Tool services run standalone on any host.
"""
