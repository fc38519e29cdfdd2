"""Listening sockets bound before a server starts, so a taken port fails start with a message
that names the setting, and one process can serve several ports (the data plane's API and
metrics ports, the control plane's public and internal ports)."""

from __future__ import annotations

import socket


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0: a free one); OSError when the port is taken.
    uvicorn starts listening on it (`Server.run(sockets=[...])`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def port_of(sock: socket.socket) -> int:
    """The port `sock` is bound to."""
    port: int = sock.getsockname()[1]
    return port
