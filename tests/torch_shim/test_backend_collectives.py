"""init_process_group("reducer"): each collective, each wire, real daemons and 2 workers.

Every worker is a torchrun-style process (backend_workers.init_worker) that
calls init_process_group("reducer") with no other argument than a timeout,
so the group reads REDUCER_* and torch's own variables. Each wire dtype is
a process group of its own (dist.new_group with ReducerOptions), and
all_reduce on it is checked against the float64 sum of every rank's input
with the integration tests' derived bounds. Broadcast, the gathers and
scatter are exact for every dtype; the refused ops raise naming the op.
"""

from __future__ import annotations

import datetime

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from backend_workers import init_worker, torchrun_env  # noqa: E402
from support import run_workers  # noqa: E402

pytestmark = pytest.mark.timeout(240)

WIRES = ("float16", "bfloat16", "float32", "int8", "fp8_e4m3")
NUMEL = 3001  # not a whole number of int8 blocks


def _inputs(world: int, wire: str) -> list[np.ndarray]:
    from test_quant_wire import make_inputs

    if wire in ("int8", "fp8_e4m3"):
        return make_inputs(world, 7, NUMEL, wire)
    from core_cases import make_input

    return [make_input(7, r, 0, NUMEL) for r in range(world)]


def _ratio(inputs: list[np.ndarray], got: np.ndarray, wire: str, op: str) -> float:
    """max |got - float64 reference| / derived bound."""
    reference = sum(x.astype(np.float64) for x in inputs)
    if op == "mean":
        reference = reference / len(inputs)
    if wire in ("int8", "fp8_e4m3"):
        from test_quant_wire import wire_bound

        bound = wire_bound(inputs, wire, op)
    else:
        from core_cases import error_bound

        bound = error_bound(inputs, reference, wire, op)
    return float(np.max(np.abs(got.astype(np.float64) - reference) / bound))


def collectives_worker(rank: int, world: int, env: dict[str, str]) -> dict:
    init_worker(rank, world, env)
    import reducer_client.torch  # noqa: F401 - registers "reducer"
    from reducer_client.torch.backend import ReducerOptions, ReducerProcessGroup

    dist.init_process_group("reducer", timeout=datetime.timedelta(seconds=30))
    out: dict = {"backend": dist.get_backend(), "group": type(dist.group.WORLD).__name__}
    try:
        for wire in WIRES:
            group = dist.new_group(backend="reducer", pg_options=ReducerOptions(wire_dtype=wire))
            assert isinstance(group, ReducerProcessGroup)
            inputs = _inputs(world, wire)
            for op, torch_op in (("sum", dist.ReduceOp.SUM), ("mean", dist.ReduceOp.AVG)):
                t = torch.from_numpy(inputs[rank].copy())
                dist.all_reduce(t, op=torch_op, group=group)
                out[wire, op] = _ratio(inputs, t.numpy(), wire, op)
                out[wire, op, "lossy"] = not np.array_equal(
                    t.numpy(), sum(x.astype(np.float64) for x in inputs).astype(np.float32))

        # all_reduce unchecked (the default) of float64, bfloat16, complex and
        # non-contiguous tensors: 40 calls, under a bounded set of keys.
        exact_sums = []
        for i in range(40):
            dtype = (torch.float32, torch.float64, torch.bfloat16, torch.complex64)[i % 4]
            t = torch.full((2, 3 + i), float(rank + i)).to(dtype)
            t = t.t() if i % 5 == 0 else t  # not contiguous: reduced in a host copy
            dist.all_reduce(t)
            exact_sums.append(bool(torch.all(t == 2 * i + 1)) and t.dtype == dtype)
        keys = {k for k in dist.group.WORLD.reducer._rounds if k.startswith("pg/all_reduce/")}
        out["unchecked"] = (all(exact_sums), len(keys))

        # async_op: a Work that is not done before the daemons answer, then is.
        t = torch.full((1 << 16,), float(rank + 1))
        work = dist.all_reduce(t, async_op=True)
        out["async"] = (isinstance(work, dist.Work), work.wait(), work.is_completed(),
                        float(t[0]), float(work.get_future().wait()[0][0]))
        fut = dist.all_reduce(torch.ones(3), async_op=True).get_future()
        out["future"] = fut.then(lambda f: f.value()[0] * 10).wait().tolist()

        ints = torch.tensor([rank + 1, 2 ** 40 + rank], dtype=torch.int64)
        dist.all_reduce(ints)
        flags = torch.tensor([rank == 1, False])
        dist.all_reduce(flags)
        out["exact_sum"] = (ints.tolist(), flags.tolist())

        for dtype in (torch.float64, torch.bfloat16, torch.int32, torch.uint8):
            src = (torch.arange(6) * 37 % 251).to(dtype) / (3 if dtype.is_floating_point else 1)
            src = src.to(dtype)
            got = src.clone() if rank == 0 else torch.zeros_like(src)
            dist.broadcast(got, src=0)
            outs = [torch.zeros_like(src) for _ in range(world)]
            dist.all_gather(outs, src + rank)
            flat = torch.zeros(world * src.numel(), dtype=dtype)
            dist.all_gather_into_tensor(flat, src + rank)
            out["exact", str(dtype)] = (
                torch.equal(got, src),
                all(torch.equal(o, (src + r).to(dtype)) for r, o in enumerate(outs)),
                torch.equal(flat, torch.cat([(src + r).to(dtype) for r in range(world)])))

        rows = torch.arange(4.0 * world) + rank  # float32 wire for the exact sums below
        exact = dist.new_group(backend="reducer", pg_options=ReducerOptions("float32"))
        piece = torch.zeros(4)
        dist.reduce_scatter_tensor(piece, rows, group=exact)
        listed = torch.zeros(4)
        dist.reduce_scatter(listed, list(rows.chunk(world)), group=exact)
        out["reduce_scatter"] = (piece.tolist(), listed.tolist())
        reduced = torch.full((3,), rank + 1.0)
        dist.reduce(reduced, dst=1, group=exact)
        out["reduce"] = reduced.tolist()

        gathered = [torch.zeros(2) for _ in range(world)] if rank == 0 else None
        dist.gather(torch.full((2,), rank + 0.5), gathered, dst=0)
        scattered = torch.zeros(2)
        dist.scatter(scattered, [torch.full((2,), r * 10.0) for r in range(world)]
                     if rank == 0 else None, src=0)
        out["gather_scatter"] = ([g.tolist() for g in gathered] if gathered else None,
                                 scattered.tolist())

        dist.barrier()
        objs: list = [None] * world
        dist.all_gather_object(objs, {"rank": rank, "text": "é" * rank})
        listed_objs = [{"from": 0}, 3] if rank == 0 else [None, None]
        dist.broadcast_object_list(listed_objs, src=0)
        out["objects"] = (objs, listed_objs)

        refused = {}
        for name in ("MAX", "MIN", "PRODUCT", "BAND"):
            try:
                dist.all_reduce(torch.ones(2), op=getattr(dist.ReduceOp, name))
            except Exception as exc:
                refused[name] = f"{type(exc).__name__}: {exc}"
        try:
            dist.send(torch.ones(2), dst=1 - rank)
        except Exception as exc:
            refused["send"] = f"{type(exc).__name__}: {exc}"
        out["refused"] = refused
        dist.barrier()  # the ranks still agree on their rounds after the refusals
    finally:
        dist.destroy_process_group()
    return out


def test_every_collective_and_wire_through_the_daemons(daemons):
    world = 2
    with daemons(2, round_timeout=30) as d:
        results = run_workers(collectives_worker, world,
                              (torchrun_env(d.addresses, REDUCER_WIRE_DTYPE="float32"),),
                              timeout=200)
    for rank, out in enumerate(results):
        assert out["backend"] == "reducer" and out["group"] == "ReducerProcessGroup"
        for wire in WIRES:
            for op in ("sum", "mean"):
                print(f"rank {rank} {wire} {op}: error / bound = {out[wire, op]:.3f}")
                assert out[wire, op] <= 1.0, (wire, op, out[wire, op])
                if wire != "float32":  # the wire really was the group's
                    assert out[wire, op, "lossy"], (wire, op)
        assert out["unchecked"] == (True, 32)  # the keys taken in turn, bounded
        assert out["async"] == (True, True, True, 3.0, 3.0)
        assert out["future"] == [20.0, 20.0, 20.0]
        assert out["exact_sum"] == ([3, 2 ** 41 + 1], [True, False])
        for key, value in out.items():
            if key[0] == "exact":
                assert value == (True, True, True), (key, value)
        both = np.arange(4.0 * world) * 2 + 1  # rows of rank 0 plus rows of rank 1
        assert out["reduce_scatter"] == (both[4 * rank:4 * rank + 4].tolist(),) * 2
        if rank == 1:
            assert out["reduce"] == [3.0] * 3
        else:
            assert out["reduce"] == [1.0] * 3  # reduce leaves other ranks' input as it was
        assert out["gather_scatter"] == ([[0.5, 0.5], [1.5, 1.5]] if rank == 0 else None,
                                         [rank * 10.0] * 2)
        assert out["objects"] == ([{"rank": 0, "text": ""}, {"rank": 1, "text": "é"}],
                                  [{"from": 0}, 3])
        for name, message in out["refused"].items():
            assert "reducer backend" in message and "gloo" in message.lower(), message
            if name != "send":
                assert message.startswith("UnsupportedOpError") and f"ReduceOp.{name}" in message
        assert set(out["refused"]) == {"MAX", "MIN", "PRODUCT", "BAND", "send"}


def split_worker(rank: int, world: int, env: dict[str, str]) -> dict:
    """init_process_group("cpu:gloo,cuda:reducer"): CPU tensors go to Gloo."""
    init_worker(rank, world, env)
    import reducer_client.torch  # noqa: F401

    dist.init_process_group("cpu:gloo,cuda:reducer", timeout=datetime.timedelta(seconds=30))
    try:
        group = dist.group.WORLD
        t = torch.tensor([float(rank), 5.0 - rank])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # Gloo's: the daemons cannot do MAX
        peer = torch.zeros(1)
        if rank == 0:
            dist.send(torch.tensor([42.0]), dst=1)
        else:
            dist.recv(peer, src=0)
        return {"group": type(group).__name__, "gloo": group._cpu is not None,
                "max": t.tolist(), "peer": peer.tolist(),
                "backend": dist.get_backend()}
    finally:
        dist.destroy_process_group()


def test_cpu_gloo_cuda_reducer_sends_cpu_tensors_to_gloo(daemons):
    with daemons(1, round_timeout=30) as d:
        results = run_workers(split_worker, 2, (torchrun_env(d.addresses),), timeout=120)
    for rank, out in enumerate(results):
        assert out["group"] == "ReducerProcessGroup" and out["gloo"]
        assert out["max"] == [1.0, 5.0]
        assert out["peer"] == ([0.0] if rank == 0 else [42.0])
