"""agentrl's OpenAI-compatible gateway: agents written against the OpenAI chat API run through
agentrl's inference pool, and every session's exact token records, log-probs and policy versions are
recorded for training (`server` for the endpoints, `render` for prompts and splicing, `sessions`
for the record and its segments, `agents` for `[agent]` programs trained through it, `cli` for
`agentrl gateway`). Import rule: agentrl.gateway imports only agentrl.common and agentrl.engine."""
