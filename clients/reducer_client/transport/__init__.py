"""How the client reaches the daemons: one DaemonLink per daemon (link.py:
what to send, resend and give up on; history.py: what it keeps for a resend,
bounded, and the recycled send buffers) over one transport seam (base.py),
with the daemon's TCP data plane (tcp.py), its gRPC service (grpc.py) and an
in-process fake daemon for tests (fake.py) behind it."""
