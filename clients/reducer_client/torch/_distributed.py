"""Registers the "reducer" torch.distributed backend where torch has torch.distributed.

A module of its own so that reducer_client.torch imports without
torch.distributed (some builds leave it out); backend.py registers on import.
"""

import torch.distributed as dist

if dist.is_available():
    from reducer_client.torch import backend  # noqa: F401 - registers "reducer"
