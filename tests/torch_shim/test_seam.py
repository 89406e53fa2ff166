"""The shim seam (reducer_client.api.Reducer): LocalGroup against ReducerClient.

Real daemons on 127.0.0.1; two ranks as threads of this process, one
ReducerClient each. LocalGroup must give the same bits as the daemons for
every wire dtype and op, with out= (also out= the input); rounds of one key
may differ in length, which is what lets unnamed shim calls share one key.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from reducer_client import ReducerClient, collectives
from reducer_client.api import Reducer
from reducer_client.testing import LocalGroup

WORLD_SIZE = 2
TIMEOUT_S = 20.0


def _inputs(dtype: str) -> list[np.ndarray]:
    """Values that round differently on every wire: random magnitudes over many
    binades, both signs, signed zeros, a float16 subnormal and overflow."""
    rng = np.random.default_rng(5)
    arrays = []
    for rank in range(WORLD_SIZE):
        x = rng.normal(size=3000) * np.exp2(rng.integers(-20, 12, size=3000))
        x[:4] = [0.0, -0.0, 1e-7, 7e4 * (rank + 1)]
        with np.errstate(over="ignore"):  # 7e4 is inf in float16: meant
            arrays.append(x.astype(dtype))
    return arrays


def _run(reducers: list[Reducer], inputs: list[np.ndarray], op: str, key: str,
         in_place: bool) -> list[np.ndarray]:
    def one(rank: int) -> np.ndarray:
        array = inputs[rank].copy()
        out = array if in_place else np.empty_like(array)
        result = reducers[rank].allreduce_async(array, key, op, out=out).result(TIMEOUT_S)
        assert result is out
        return result
    with ThreadPoolExecutor(WORLD_SIZE) as pool:
        return list(pool.map(one, range(WORLD_SIZE)))


@pytest.fixture(scope="module")
def daemon_addresses(tmp_path_factory):
    from support import running_daemons

    with running_daemons(2, log_dir=tmp_path_factory.mktemp("logs"), round_timeout=20) as d:
        yield d.addresses


def _clients(addresses: list[str], wire_dtype: str, **kwargs) -> list[ReducerClient]:
    job = uuid.uuid4().hex
    return [ReducerClient(addresses, job, rank, WORLD_SIZE, wire_dtype=wire_dtype,
                          timeout=TIMEOUT_S, node_local=False, **kwargs)
            for rank in range(WORLD_SIZE)]


# The core warns when float64 input overflows the float16 wire; that is meant.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("wire_dtype", ["float16", "bfloat16", "float32", "int8", "fp8_e4m3",
                                        "fp8_e5m2"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_local_group_gives_the_daemons_bits(daemon_addresses, wire_dtype, dtype):
    inputs = _inputs(dtype)
    group = LocalGroup(WORLD_SIZE, timeout=TIMEOUT_S, wire_dtype=wire_dtype)
    local = [group.client(rank) for rank in range(WORLD_SIZE)]
    real = _clients(daemon_addresses, wire_dtype)
    try:
        assert all(isinstance(r, Reducer) for r in (*local, *real))
        assert [r.wire_dtype for r in local] == [wire_dtype] * WORLD_SIZE
        for op in ("sum", "mean"):
            for in_place in (False, True):
                want = _run(real, inputs, op, "x", in_place)
                got = _run(local, inputs, op, "x", in_place)
                for g, w in zip(got, want, strict=True):
                    assert g.dtype == w.dtype == np.dtype(dtype)
                    # Bits, not values: -0.0, inf and NaN must agree too.
                    assert np.array_equal(g.view(f"u{g.itemsize}"), w.view(f"u{w.itemsize}"))
    finally:
        for client in real:
            client.close()


def test_local_group_checks_out_as_the_client_does():
    client = LocalGroup(1).client(0)
    x = np.ones(4, np.float32)
    for bad in (np.ones(5, np.float32), np.ones(4, np.float64), np.ones(8, np.float32)[::2]):
        with pytest.raises(ValueError, match="out must be a writable C-contiguous"):
            client.allreduce(x, "k", out=bad)
    with pytest.raises(ValueError, match="op 'max'"):
        client.allreduce(x, "k", op="max")
    with pytest.raises(TypeError, match="uint16 is not supported"):
        client.allreduce(np.ones(4, np.uint16), "k")
    with pytest.raises(ValueError, match="integer allreduce sums only"):
        client.allreduce(np.ones(4, np.int64), "k", op="mean")
    with pytest.raises(ValueError, match="wire_dtype 'int4'"):
        LocalGroup(1, wire_dtype="int4")


def test_unnamed_calls_share_one_key_whatever_their_lengths(daemon_addresses):
    """200 unnamed rt.allreduce calls of changing lengths (1 to 5 chunks per
    daemon): right results, and the client's keys stay the same two."""
    torch = pytest.importorskip("torch")
    import reducer_client.torch as rt

    real = _clients(daemon_addresses, "float32", chunk_bytes=4096)
    lengths = [1 + (i * 2399) % 5000 for i in range(200)]

    def work(rank: int) -> tuple[list[float], list[int]]:
        client, sums, keys = real[rank], [], []
        for i, n in enumerate(lengths):
            tensor = torch.full((n,), float(rank + i))
            result = rt.allreduce(tensor, op="sum", reducer=client)
            assert result.shape == (n,) and torch.all(result == result[0])
            sums.append(result[0].item())
            keys.append(len(client._rounds))
        return sums, keys
    try:
        with ThreadPoolExecutor(WORLD_SIZE) as pool:
            results = list(pool.map(work, range(WORLD_SIZE), timeout=120))
    finally:
        for client in real:
            client.close()
    for sums, keys in results:
        assert sums == [float(2 * i + 1) for i in range(len(lengths))]
        # Bounded keys: the cross-rank checks' and the data's, each taken in turn.
        assert max(keys) == 2 * collectives.DATA_KEYS
    rounds = dict(real[0]._rounds)
    data = {key: n for key, n in rounds.items() if key.startswith(collectives.DATA_KEY)}
    assert set(data) == {collectives.data_key(i) for i in range(collectives.DATA_KEYS)}
    assert sum(data.values()) == len(lengths)
    assert sum(rounds.values()) == 2 * len(lengths)  # a control round per call
