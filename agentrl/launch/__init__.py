"""Where a run's processes go on a cluster.

A run starts four kinds of role: tool services, inference servers, learners and the actor. Each is
described as picklable data (agentrl/engine/roles.py: `CommandRole`, `VLLMRole`) and started by
`start_role` on the host it lands on, which binds its own ports there. A launcher decides where:
`place(name, kind)` gives a slot (the address roles bind there, free endpoints on that host), and
`slot.start(role)` starts the role and reports its endpoint; the slot then answers poll / signal /
stop / log_tail like a child process.

- `agentrl.engine.roles.LocalLauncher`: every role a child process of `agentrl train` (the default).
- `ray_launcher.RayLauncher`: every role under a host actor on the Ray node that offers the role's
  resources (`[cluster]`, plan.py); Ray places, starts and watches, the data plane stays ZeroMQ and
  HTTP, and the roles' processes never import Ray.
"""
