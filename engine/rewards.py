"""Process reward terms: their names and raw values.

The `ToolEnv` records every reward term raw and separately: per turn a dict of process terms
(`Turn.process_rewards`), per episode one task reward. Nothing is weighted at rollout time;
weighting (the reward schedule) is the learner's, at training time (agentrl.learner.rewards).
"""

from __future__ import annotations

from agentrl.common.config import config_dataclass

# Names of the process reward terms the ToolEnv emits (keys of Turn.process_rewards).
VALID_CALL = "valid_call"
TOOL_SUCCESS = "tool_success"
DUPLICATE_CALL = "duplicate_call"
MALFORMED_CALL = "malformed_call"
OVER_LIMIT = "over_limit"
TOOL_DIVERSITY = "tool_diversity"
NO_ACTION = "no_action"
NO_ANSWER = "no_answer"


@config_dataclass
class ProcessRewardConfig:
    """Raw value of each process reward term, per occurrence (unitless reward points)."""

    valid_call: float = 0.1
    """Per call that parsed, names a registered tool and satisfies its schema, within limits."""
    tool_success: float = 0.1
    """Per call whose tool succeeded and that repeats no earlier call of the episode."""
    duplicate_call: float = -0.05
    """Per call identical (tool + arguments) to an earlier one in the episode."""
    malformed_call: float = -0.2
    """Per malformed call: bad JSON, truncated tag, unknown tool, schema violation, unclosed answer."""
    over_limit: float = -0.1
    """Per call beyond the per-turn or per-episode call limit (not executed)."""
    tool_diversity: float = 0.05
    """Once per distinct tool used successfully in the episode, from the second distinct tool on."""
    no_action: float = -0.1
    """A turn with neither a tool call nor an answer."""
    no_answer: float = 0.0
    """Once, on the last turn, when the episode ends without an answer (turn or token limit; not
    an infrastructure failure); 0 = not charged. With per-call terms and no such cost, searching
    until the turns run out can pay better than answering: seen in a CPU run (process weight 0.55),
    tool calls per episode went from 1.4 to 3.5 and the sampled EM from 0.25 to 0 within 12 RL
    steps. The CPU default sets -0.5."""

    def value(self, term: str) -> float:
        return float(getattr(self, term))
