"""How the client reaches the daemons: one DaemonLink per daemon (link.py) over
the TCP data plane (tcp.py) or gRPC."""
