"""The reduction core: the table of open chunks, their sums, results and limits.

Plain Python, NumPy and the C summing pool; nothing here knows of sockets,
gRPC or the daemon's configuration. Every layer above imports it; it imports
only reducer_wire.
"""
