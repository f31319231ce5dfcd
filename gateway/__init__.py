"""agentrl's OpenAI-compatible gateway: agents written against the OpenAI chat API run through
agentrl's inference pool, and every session's exact token ids, log-probs and policy versions are
recorded for training (`server` for the endpoints, `render` for prompts and splicing, `sessions`
for the record and its segments, `cli` for `agentrl gateway`).
Imports: agentrl.common and agentrl.engine (the inference pool, parsers, chat format), nothing else."""
