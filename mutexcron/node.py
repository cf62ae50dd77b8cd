"""Who this process is: a node id unique per process, and this host's outbound IP."""

from __future__ import annotations

import os
import secrets
import socket


def default_node_id() -> str:
    """``hostname:pid:random``: two processes on one host are two different holders."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def outbound_ip() -> str:
    """The IP this host would use to reach the network, found without sending a packet.

    Connecting a UDP socket only asks the kernel for a route; nothing is sent. The target is in
    TEST-NET-1 (192.0.2.0/24, reserved for documentation), so it is never a real host.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("192.0.2.1", 9))
            ip = str(sock.getsockname()[0])
            if ip and not ip.startswith("0."):
                return ip
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
