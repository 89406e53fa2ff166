"""Workers and helpers of the "reducer" torch.distributed backend tests.

Spawned workers import this module (tests/torch_shim is on their sys.path, as
in the parent). Each worker is a torchrun-style process: RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and the REDUCER_*
variables in its environment, and init_process_group("reducer") reads them.
The float64-reference bounds are the integration tests' own:
core_cases.error_bound (float16, bfloat16, float32 wires) and
test_quant_wire.wire_bound (8-bit wires).
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

__all__ = ["torchrun_env", "init_worker", "free_port"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_env(addresses: list[str], **extra: str) -> dict[str, str]:
    """What torchrun and the operator would set, less the per-rank variables."""
    return {"REDUCER_ADDRESSES": ",".join(addresses), "REDUCER_JOB": uuid.uuid4().hex,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **extra}


def init_worker(rank: int, world_size: int, env: dict[str, str]) -> None:
    """Set this rank's torchrun variables (the process is this rank's alone)."""
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0")
    import torch

    torch.set_num_threads(1)
