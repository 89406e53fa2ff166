"""The daemon itself: the gRPC servicer, the Daemon that assembles every layer, `reducerd status`.

The top layer; only reducerd.__main__ imports it.
"""
