"""Loopback ports for the servers the tests start."""

from __future__ import annotations

import random
import socket

_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback port nothing listens on, below the kernel's ephemeral range. A port the kernel hands
    out for bind(0) comes from that range, where outgoing connections (gRPC channels, gloo's) take
    theirs too: one could take it between this check and the server's bind, and the server exits with
    "address already in use" (two servers of a CI run did). Ports below the range are taken only by
    binding them explicitly; each is handed out once a process."""
    low = _ephemeral_low()
    for _ in range(1000):
        port = random.randint(10000, low - 1) if low > 10001 else random.randint(1024, 65535)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free loopback port found below the ephemeral range")
