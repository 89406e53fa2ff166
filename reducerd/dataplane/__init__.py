"""The daemon's TCP data plane: connections, their readers and writers.

Above the service (each connection is a Stream of the Session), below the
daemon that starts it.
"""
