"""The shim's basics (reducer_client.process.Basics).

mx.kv.create("reducer") builds the store without arguments, so client()
here creates the process-wide client from the environment on first use
instead of asking for init() first.
"""

from __future__ import annotations

from reducer_client.process import Basics

__all__ = ["basics"]

basics = Basics("reducer_client.mxnet", create_on_use=True)
