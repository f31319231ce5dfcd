"""Who may use a vLLM server's weight-control endpoints: the rule of the ASGI middleware the server
loads with `--middleware agentrl.common.server_control.control_middleware` (engine/serve.py always
passes it; agentrl/common/server_control.py).

The server runs with `VLLM_SERVER_DEV_MODE=1`, which the hot swap needs (`/collective_rpc`,
`/pause`, `/resume`, `/update_weight_version`, `/reset_prefix_cache`), and which also exposes
`/sleep`, `/server_info` and more. vLLM's own `--api-key` guards only `/v1` routes, so anyone who
can reach the port could otherwise pause the server or load arbitrary weights into it.

The rule: generation and read-only probes (`PUBLIC_PREFIXES`) are open as before; every other path
needs either a loopback peer (127.0.0.0/8, ::1) when no token is set, or, when the server's
environment holds `AGENTRL_CONTROL_TOKEN`, the header `X-Agentrl-Control-Token` with that value
(from any peer, loopback included). `agentrl serve-model` refuses a non-loopback `--host` without a
token; the learner's push (`common/weights.py`) sends the token from its own environment. The
middleware also serves `/agentrl/weights` (a push's bytes over the network) once the request has
passed that rule.
"""

from __future__ import annotations

import hmac
import ipaddress
import os

UPLOAD_PATH = "/agentrl/weights"
"""Where the `stream` transport uploads a push (agentrl.common.server_control)."""
SIZE_HEADER = "X-Agentrl-Size"
SHA256_HEADER = "X-Agentrl-Sha256"
CONTROL_TOKEN_ENV = "AGENTRL_CONTROL_TOKEN"
CONTROL_TOKEN_HEADER = "X-Agentrl-Control-Token"
PUBLIC_PREFIXES = ("/v1/", "/inference/v1/", "/health", "/ping", "/version", "/metrics", "/tokenize",
                   "/detokenize", "/weight_info", "/is_paused", "/docs", "/openapi.json")
"""Paths anyone who reaches the server may use: generation and read-only probes."""


_process_token: str | None = None


def use_control_token(token: str | None) -> None:
    """Send `token` with this process's control requests (a run's provisioned token, which
    `agentrl train` keeps out of its environment so that only the processes it hands it to have it)."""
    global _process_token
    _process_token = token


def control_headers() -> dict[str, str]:
    """The header a weight push sends: this process's token (`use_control_token`), else its
    environment's, if any."""
    token = _process_token or os.environ.get(CONTROL_TOKEN_ENV)
    return {CONTROL_TOKEN_HEADER: token} if token else {}


CONTROL_UNDER_PUBLIC = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
"""Control paths under a public prefix: vLLM's runtime LoRA loading (a push on a server that serves
the adapter itself) would otherwise let anyone load an adapter from any path on the server."""


def is_public(path: str) -> bool:
    if path.rstrip("/") in CONTROL_UNDER_PUBLIC:
        return False
    return path in ("/health", "/ping", "/version", "/metrics") or path.startswith(PUBLIC_PREFIXES)


def is_loopback(host: str | None) -> bool:
    if host == "localhost":
        return True
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed(path: str, peer_host: str | None, given_token: str | None, token: str | None) -> tuple[bool, str]:
    """(allowed, why not) for one request."""
    if is_public(path):
        return True, ""
    if token:
        if given_token is not None and hmac.compare_digest(given_token.encode(), token.encode()):
            return True, ""
        return False, f"{path} needs the {CONTROL_TOKEN_HEADER} header (the server's {CONTROL_TOKEN_ENV})"
    if is_loopback(peer_host):
        return True, ""
    return False, f"{path} is a weight-control endpoint: loopback peers only (the server has no {CONTROL_TOKEN_ENV})"
