"""The gateway's config (`agentrl gateway`, and the gateway `agentrl train` starts for agent commands)."""

from __future__ import annotations

from typing import Literal

from agentrl.common.config import config_dataclass
from agentrl.engine.parsers import TOOL_CALL_PARSERS


@config_dataclass
class GatewayConfig:
    """The OpenAI-compatible gateway (`agentrl gateway`, and the one `agentrl train` starts for agent commands)."""

    host: str = "127.0.0.1"
    port: int = 8100
    """0 picks a free port (the bound URL is printed and returned by `start`)."""
    served_model_name: str | None = None
    """The `model` clients send; None: the model folder's name."""
    max_model_len: int = 4096
    """Prompt + completion limit of the inference servers, tokens."""
    tool_parser: str = "auto"
    """"hermes" | "llama3_json" | "mistral" | "auto" (from the tokenizer's vocabulary)."""
    renderer: Literal["auto", "chatml", "template"] = "auto"
    """"chatml" (agentrl's ids-first ChatML/Hermes layout), "template" (the tokenizer's Jinja
    template) or "auto": "template" when the template handles `tools`, else "chatml"."""
    session_idle_s: float = 600.0
    """A session idle this long (no request in flight) is expired, seconds."""
    max_sessions: int = 16384
    """Open sessions at most; one more is refused with 429."""
    sweep_interval_s: float | None = None
    """How often idle sessions are looked for, seconds; None: min(10, session_idle_s / 2)."""
    max_body_bytes: int = 32 * 2**20
    """Largest request body; beyond it the request is refused with 413."""
    default_temperature: float = 1.0
    """Temperature when a request sends none (OpenAI's default)."""
    gc_threshold0: int | None = 100_000
    """Young-generation threshold of the cyclic garbage collector while serving (CPython's default:
    700); None leaves it alone. With 1,024 sessions open the default collector re-traverses their
    records again and again: measured in benchmarks/gateway.py, 844 CPU us per turn at the default
    against 607 at 100,000. Request handling frees its objects by reference counting."""
    shutdown_grace_s: float = 5.0
    """On stop, how long requests in flight may still run before they are cancelled, seconds."""
    render_check_every: int = 8
    """Re-render one recalled completion in this many from its text and compare with its sampled
    ids (1: every one; 0: never); a difference counts in `num_render_drifts` and logs the first
    differing prompt position. A check costs one tokenizer encode, ~40 to 55 us for a 30-token
    call, a sixth of the gateway's whole CPU per turn (~350 us in benchmarks/gateway.py); a
    rendering mismatch is systematic (a format, not a sample), so one in 8 finds it within a few
    turns. Training never depends on it: recalled completions enter prompts as their recorded ids
    either way."""

    def __post_init__(self) -> None:
        if self.tool_parser != "auto" and self.tool_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_parser: must be 'auto' or one of {sorted(TOOL_CALL_PARSERS)}, got {self.tool_parser!r}")
        if self.render_check_every < 0:
            raise ValueError(f"render_check_every: must be >= 0, got {self.render_check_every}")
        if self.gc_threshold0 is not None and self.gc_threshold0 < 1:
            raise ValueError(f"gc_threshold0: must be >= 1 (or not set), got {self.gc_threshold0}")
        if self.max_model_len < 2 or self.max_sessions < 1:
            raise ValueError("max_model_len: needs max_model_len >= 2 and max_sessions >= 1")
        if self.session_idle_s <= 0 or (self.sweep_interval_s is not None and self.sweep_interval_s <= 0):
            raise ValueError("session_idle_s: needs session_idle_s > 0 and sweep_interval_s > 0")
        if not 0 <= self.port <= 65535 or self.max_body_bytes < 1 or self.shutdown_grace_s < 0:
            raise ValueError("port: needs 0 <= port <= 65535, max_body_bytes >= 1 and shutdown_grace_s >= 0")
