"""This machine's network addresses, for tests that bind off loopback."""

from __future__ import annotations

import socket


def routable_address() -> str | None:
    """The IPv4 address of this machine's default route (a UDP connect sends no packet), or None
    when it has none besides loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))  # TEST-NET-2: only the route is looked up
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address
