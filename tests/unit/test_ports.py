"""The test servers' ports come from below the kernel's ephemeral range (tests/ports.py): a port of that
range can be taken by any outgoing connection before the server binds it."""

from __future__ import annotations

import socket

from ports import _ephemeral_low, free_port


def test_free_ports_are_bindable_below_the_ephemeral_range_and_never_handed_out_twice() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(1024 <= port < _ephemeral_low() for port in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))
