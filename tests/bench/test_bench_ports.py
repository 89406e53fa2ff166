"""Ports the bench hands out in advance (Gloo masters, loopback daemons)."""

import socket

from reducerd.bench import session


def test_free_ports_lie_below_the_ephemeral_range_and_can_be_bound():
    """A source port of some connect() can never take one of them first."""
    low, _ = session._ephemeral_range()
    for _ in range(20):
        port = session.free_port()
        assert 1024 <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_held_by_a_listener_is_not_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        # Candidates: the 1,002 ports below the held one and the held one, skipped.
        monkeypatch.setattr(session, "_ephemeral_range", lambda: (taken + 1, 60999))
        monkeypatch.setattr(session, "_LOWEST_PORT", taken - 1000 - 2)
        ports = {session.free_port() for _ in range(50)}
        assert taken not in ports and ports
