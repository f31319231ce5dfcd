"""CurveZMQ for every ZeroMQ socket of the project that binds: one rule, one set of helpers.

The rule (tool services, the learner's group receiver and version publisher):
- an endpoint only this host can reach (`is_local_endpoint`: loopback TCP, ipc://, inproc://)
  needs nothing;
- any other bind needs CurveZMQ keys: the binding side's secret certificate (zmq.auth
  `NAME.key_secret`) and a directory of the public certificates (`*.key`) of the clients it lets
  in. The connecting side then needs the server's public certificate and its own secret one.
Keys are given both or neither, and are read and checked when the config is built (a missing or
unreadable file, a certificate without a secret key, a directory with no `*.key`: ValueError naming
the config key), so a bad key stops a process before it opens a socket.

Keys are made with `zmq.auth.create_certificates(DIR, NAME)`, which writes DIR/NAME.key (public:
give it to the other side) and DIR/NAME.key_secret (keep it).

On the binding side, `curve_server(ctx, sock, keys)` starts a ZAP authenticator on the socket's
context and makes the socket a CURVE server. The authenticator matters as much as the keys: a
CURVE server with no ZAP handler on its context encrypts but lets any client key in (libzmq
4.3's default). It runs in a thread of its own (`ThreadAuthenticator`), not on the owner's event
loop, so a learner busy in an optimizer step still answers handshakes. It reads the client
directory once, at start: a key added later is seen by the next process start.
"""

from __future__ import annotations

import ipaddress
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

KEY_LENGTH_Z85 = 40
"""A Curve25519 key is 32 bytes, 40 characters in Z85 (what zmq.auth certificates hold)."""

MAKE_KEYS = ("`python -c \"import zmq.auth; zmq.auth.create_certificates('keys', 'server'); "
             "zmq.auth.create_certificates('clients', 'NAME')\"` (one client certificate per connecting process)")
"""How to make keys, for error messages."""


@dataclass(frozen=True)
class ServerKeys:
    """What a binding socket needs: its own key pair and the client keys it lets in (all Z85)."""

    public_key: bytes
    secret_key: bytes
    authorized_clients_dir: str
    """Directory of the allowed clients' public certificates (`*.key`); the authenticator reads it."""


@dataclass(frozen=True)
class ClientKeys:
    """What a connecting socket needs (all Z85)."""

    server_public_key: bytes
    public_key: bytes
    secret_key: bytes


def is_local_endpoint(endpoint: str) -> bool:
    """True if binding `endpoint` is reachable only from this host (loopback TCP, ipc, inproc);
    ValueError for a scheme other than tcp, ipc, inproc."""
    parts = urlsplit(endpoint)
    if parts.scheme in ("ipc", "inproc"):
        return True
    if parts.scheme != "tcp":
        raise ValueError(f"unsupported endpoint {endpoint!r}: use tcp://HOST:PORT (or ipc://PATH)")
    host = parts.hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # '*', an interface name or a DNS name: reachable from outside


def require_curve_off_loopback(endpoint: str, keys: ServerKeys | None, *, key: str, why: str, how: str) -> None:
    """The binding rule: ValueError unless `endpoint` is local or `keys` are given. `key` names the
    endpoint's config key, `why` says what a stranger could do, `how` how to pass keys."""
    try:
        local = is_local_endpoint(endpoint)
    except ValueError as err:
        raise ValueError(f"{key}: {err}") from None
    if not local and keys is None:
        raise ValueError(
            f"{key}: refusing to bind {endpoint}: it is reachable from other hosts and {why}, so a non-loopback "
            f"bind requires CurveZMQ encryption and client authentication. Create keys with {MAKE_KEYS}, then "
            f"{how}; or bind tcp://127.0.0.1:PORT (or ipc://PATH).")


def load_server_keys(secret_key_file: str | None, authorized_clients_dir: str | None, *,
                     names: tuple[str, str] = ("curve_secret_key_file", "curve_authorized_clients_dir")) -> ServerKeys | None:
    """The binding side's keys, checked; None when neither is given. `names` are the two config
    keys (the errors name them)."""
    if secret_key_file is None and authorized_clients_dir is None:
        return None
    if secret_key_file is None or authorized_clients_dir is None:
        raise ValueError(f"{names[0]}: CurveZMQ needs both {names[0]} (this server's NAME.key_secret) and "
                         f"{names[1]} (a directory of the clients' *.key files), or neither")
    public, secret = _load_pair(secret_key_file, names[0])
    _check_clients_dir(authorized_clients_dir, names[1])
    return ServerKeys(public, secret, str(authorized_clients_dir))


def load_client_keys(server_key_file: str | None, client_key_file: str | None, *,
                     names: tuple[str, str] = ("curve_server_key", "curve_client_key")) -> ClientKeys | None:
    """The connecting side's keys, checked; None when neither is given. `names` are the two config
    keys: the server's public certificate (NAME.key) and this client's secret one (NAME.key_secret)."""
    if server_key_file is None and client_key_file is None:
        return None
    if server_key_file is None or client_key_file is None:
        raise ValueError(f"{names[0]}: CurveZMQ needs both {names[0]} (the server's public NAME.key) and "
                         f"{names[1]} (this client's NAME.key_secret), or neither")
    server_public, _ = _load_certificate(server_key_file, names[0])
    public, secret = _load_pair(client_key_file, names[1])
    return ClientKeys(server_public, public, secret)


def curve_server(ctx: zmq.Context, sock: zmq.Socket, keys: ServerKeys) -> ThreadAuthenticator:
    """Make `sock` (not yet bound) a CURVE server that admits only the clients in
    `keys.authorized_clients_dir`; returns the running authenticator, which the caller stops
    (`stop_authenticator`) before it destroys `ctx`."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=keys.authorized_clients_dir)
    # configure_curve logs an unreadable directory and carries on with no keys, which would refuse
    # every client without saying why; the directory was checked at config time, but may have gone.
    if not auth.certs.get("*"):
        auth.stop()
        raise ValueError(f"{keys.authorized_clients_dir}: no client certificate (*.key) could be read")
    sock.curve_secretkey = keys.secret_key
    sock.curve_publickey = keys.public_key
    sock.curve_server = True
    return auth


def curve_client(sock: zmq.Socket, keys: ClientKeys) -> None:
    """Make `sock` (not yet connected) a CURVE client of the server whose public key `keys` names."""
    sock.curve_serverkey = keys.server_public_key
    sock.curve_publickey = keys.public_key
    sock.curve_secretkey = keys.secret_key


def stop_authenticator(auth: ThreadAuthenticator | None) -> None:
    """Stop what `curve_server` started (bounded: its thread exits on the first poll turn)."""
    if auth is not None:
        auth.stop()


def write_public_certificate(path: str | Path, public_key: bytes) -> None:
    """A zmq.auth public certificate holding `public_key` (what create_certificates writes as NAME.key),
    for handing a server's public half to its clients without its secret file."""
    if not _is_key(public_key):
        raise ValueError(f"not a {KEY_LENGTH_Z85}-character Z85 key: {public_key[:8]!r}...")
    Path(path).write_text(f'#   ZeroMQ CURVE Public Certificate\n\nmetadata\ncurve\n    public-key = "{public_key.decode()}"\n')


def _load_certificate(path: str, key: str) -> tuple[bytes, bytes | None]:
    if not os.path.isfile(path):
        raise ValueError(f"{key}: no such certificate file {path}")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"{key}: cannot read the certificate {path}: {err}") from None
    for name, value in (("public", public), ("secret", secret)):
        if value is not None and not _is_key(value):
            raise ValueError(f"{key}: {path}: the {name} key is not a {KEY_LENGTH_Z85}-character Z85 key")
    return public, secret


def _load_pair(path: str, key: str) -> tuple[bytes, bytes]:
    public, secret = _load_certificate(path, key)
    if secret is None:
        raise ValueError(f"{key}: {path} holds no secret key (give the NAME.key_secret file, not NAME.key)")
    return public, secret


def _check_clients_dir(path: str, key: str) -> dict[bytes, bool]:
    if not os.path.isdir(path):
        raise ValueError(f"{key}: no such directory {path}")
    keys: dict[bytes, bool] = {}
    for cert in sorted(Path(path).glob("*.key")):
        public, _ = _load_certificate(str(cert), key)
        keys[public] = True
    if not keys:
        raise ValueError(f"{key}: {path} holds no client certificate (*.key): no client could connect")
    return keys


def _is_key(value: bytes) -> bool:
    if len(value) != KEY_LENGTH_Z85:
        return False
    try:
        z85.decode(value)
    except (ValueError, KeyError, struct.error):
        return False
    return True
