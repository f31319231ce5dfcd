"""The credentials a run makes for its endpoints: CurveZMQ certificates for the learners' sockets
and the tool services, and the control token of the vLLM servers' weight endpoints.

Everything is written under the run directory (RUN_DIR/curve/, 0700, secret files 0600;
RUN_DIR/control_token, 0600), made once and kept across `--resume`, and reaches a process as a file
path in its config or as an environment variable, never on a command line or in a log. On loopback
a run makes nothing unless `[learner.transport]` names keys of its own (then only the run's client
certificate, so its actor and SFT stream are admitted).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

RUN_CLIENT = "agentrl-run"
"""Name of the client certificate a run makes for its own connections to its learners and tools."""
RUN_LEARNER = "agentrl-run-learner"
"""Name of the learners' server certificate a run makes off loopback when [learner.transport] names none."""
RUN_TOOLS = "agentrl-run-tools"
"""Name of the certificate of the tool services a run starts off loopback."""


def certificate(folder: Path, name: str) -> Path:
    """folder/NAME.key_secret (0600) and its public half NAME.key, made once (kept across --resume)."""
    import zmq.auth

    secret = folder / f"{name}.key_secret"
    if not secret.exists():
        zmq.auth.create_certificates(folder, name)
        secret.chmod(0o600)  # create_certificates leaves it to the umask
    return secret


class RunCredentials:
    """What one run provisions, asked for by the supervisor as it writes each child's config."""

    def __init__(self, out: Path, *, host: str, learner_transport, external_vllm: bool):
        """`host`: the run's `[network] host`; `learner_transport`: `[learner.transport]` (its keys,
        if any, are the learners'); `external_vllm`: the run was given servers (`--vllm`), which
        hold their own token."""
        from agentrl.common.control_auth import is_loopback

        self.out, self.host, self.learner_transport, self.external_vllm = out, host, learner_transport, external_vllm
        self.loopback = is_loopback(host)
        self._learner: tuple[dict, dict] | None = None

    def control_token(self) -> str | None:
        """Off loopback, the vLLM server's weight endpoints need a token (common/control_auth.py): the
        run makes one (RUN_DIR/control_token, 0600, kept across --resume) unless this environment
        has one, and this process's own requests use it. It goes to the server's and the learners'
        environments only (the learners' pushes send it), never to the actor, tool services or agent
        programs. None on loopback, with servers given, or with a token in the environment."""
        from agentrl.common.control_auth import CONTROL_TOKEN_ENV, use_control_token

        if self.loopback or self.external_vllm or os.environ.get(CONTROL_TOKEN_ENV):
            return None
        path = self.out / "control_token"
        if not path.exists() or not path.read_text().strip():  # absent, or left empty by a crash
            import secrets

            partial = path.with_suffix(".partial")
            partial.unlink(missing_ok=True)
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            partial.replace(path)
        token = path.read_text().strip()
        use_control_token(token)
        return token

    def learner(self) -> tuple[dict, dict]:
        """CurveZMQ on the learners' sockets: ([learner.transport] keys of the learner configs, the
        client keys of the actor and of the SFT stream); ({}, {}) on loopback without keys in
        `[learner.transport]`, and nothing is made.

        With keys there, the run makes a client certificate for its own connections
        (RUN_DIR/curve/agentrl-run.key_secret) and the learners admit it besides the `*.key` of
        curve_authorized_clients_dir (both copied into RUN_DIR/curve/clients); the clients get the
        public half of curve_secret_key_file (RUN_DIR/curve/learner.key), never the secret file.
        Off loopback without keys, the run also makes the learners' server certificate
        (RUN_DIR/curve/agentrl-run-learner.key_secret) and admits its own client only."""
        if self._learner is not None:
            return self._learner
        import zmq.auth

        from agentrl.common.config import ConfigError
        from agentrl.common.curve import write_public_certificate

        keys = self.learner_transport.curve_keys()
        if keys is None and self.loopback:
            self._learner = ({}, {})
            return self._learner
        folder = self._folder()
        client_secret = certificate(folder, RUN_CLIENT)
        if keys is not None:
            given = sorted(Path(keys.authorized_clients_dir).glob("*.key"))
            if any(cert.name == f"{RUN_CLIENT}.key" for cert in given):
                raise ConfigError(f"learner.transport.curve_authorized_clients_dir: {keys.authorized_clients_dir} holds a "
                                  f"{RUN_CLIENT}.key, the name of the run's own client certificate; rename it")
            server_public_key, learner_keys = keys.public_key, {}
        else:
            given = []
            server_secret = certificate(folder, RUN_LEARNER)
            server_public_key, _ = zmq.auth.load_certificate(server_secret)
            learner_keys = {"curve_secret_key_file": str(server_secret)}
        clients = self._clients_folder("clients", given)
        server_public = folder / "learner.key"
        write_public_certificate(server_public, server_public_key)
        self._learner = ({**learner_keys, "curve_authorized_clients_dir": str(clients)},
                         {"curve_server_key": str(server_public), "curve_client_key": str(client_secret)})
        return self._learner

    def tools(self):
        """Off loopback: the CurveZMQ certificates of the tool services the run starts
        (RUN_DIR/curve/agentrl-run-tools.key_secret), which admit only the run's own client
        certificate (RUN_DIR/curve/tool-clients/); None on loopback."""
        from agentrl.engine.services import ToolServiceKeys

        if self.loopback:
            return None
        folder = self._folder()
        client_secret = certificate(folder, RUN_CLIENT)
        server_secret = certificate(folder, RUN_TOOLS)
        clients = self._clients_folder("tool-clients", [])
        return ToolServiceKeys(server_secret=str(server_secret), authorized_clients=str(clients),
                               server_public=str(folder / f"{RUN_TOOLS}.key"), client_secret=str(client_secret))

    def _folder(self) -> Path:
        folder = self.out / "curve"
        folder.mkdir(mode=0o700, exist_ok=True)
        return folder

    def _clients_folder(self, name: str, given: list[Path]) -> Path:
        """RUN_DIR/curve/NAME/ rebuilt with the `given` public certificates and the run's client's."""
        folder = self._folder()
        clients = folder / name
        shutil.rmtree(clients, ignore_errors=True)
        clients.mkdir()
        for cert in [*given, folder / f"{RUN_CLIENT}.key"]:
            shutil.copyfile(cert, clients / cert.name)
        return clients
