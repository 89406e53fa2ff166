"""Workers for test_integer_allreduce.py (spawned processes import this module)."""

import numpy as np
from reducer_client import ReducerClient

INTEGER_DTYPES = ("uint8", "int8", "int16", "int32", "int64")


def rank_values(dtype: str, rank: int, numel: int) -> np.ndarray:
    """Values at both ends of the dtype's range, so that sums wrap around."""
    info = np.iinfo(dtype)
    base = np.arange(numel, dtype=np.int64)
    lows = info.min + (base * (rank + 3)) % 97
    highs = info.max - (base * (rank + 5)) % 89
    return np.where(base % 2 == 0, lows, highs).astype(dtype)


def integer_worker(rank: int, world_size: int, addresses: list[str], numel: int) -> dict:
    out: dict = {}
    with ReducerClient(addresses, job="ints", rank=rank, world_size=world_size,
                       timeout=30, node_local=False) as client:
        for dtype in INTEGER_DTYPES:
            result = client.allreduce(rank_values(dtype, rank, numel), key=f"k-{dtype}")
            out[dtype] = (str(result.dtype), result.tobytes())
        try:
            client.allreduce(np.ones(4, np.int32), key="mean", op="mean")
            out["mean"] = "no error"
        except ValueError as exc:
            out["mean"] = str(exc)
    return out
