"""What every transport serves alike: who may call (tokens) and each stream's shards.

Below the two transports (the gRPC servicer in reducerd.daemon, the TCP data
plane in reducerd.dataplane), above the reduction core.
"""
