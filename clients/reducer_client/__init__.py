"""reducer_client: stream gradients to reducerd daemons and get the sums back.

The core (this package's top-level modules) imports no deep-learning framework;
reducer_client.torch, .tensorflow and .mxnet are thin shims over it.
"""

from reducer_client.client import ReducerClient
from reducer_client.errors import ReducerError

__all__ = ["ReducerClient", "ReducerError"]
