"""A daemon that is down: training raises ReducerError within the client timeout.

run_workers' own timeout is what catches a hang: it fails the test if a
worker does not come back.
"""

from __future__ import annotations

import re
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import reducer_client.torch as rt  # noqa: E402
from reducer_client import ReducerClient, ReducerError  # noqa: E402
from support import run_workers  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch_shim_models import batch, loss_of, make_model  # noqa: E402

TIMEOUT_S = 2.0
# How much later than the client's timeout a failure may surface: the
# watchdog's 0.1 s tick, DDP re-raising through C++, and two CPU cores shared
# with the daemons and the other workers.
SLACK_S = 3.0


def _outcome(action) -> tuple[str, str, str, float]:
    """(error type, error code or "", message, seconds) of action(), which must fail."""
    start = time.monotonic()
    try:
        action()
    except Exception as exc:
        code = getattr(exc, "code", None)
        return (type(exc).__name__, code.name if code is not None else "", str(exc),
                time.monotonic() - start)
    raise AssertionError("no error although the daemon is down")


def _names_the_unreachable_daemon(message: str, address: str) -> bool:
    """The message names the daemon and says it cannot be reached (connected to)."""
    return address in message and re.search(
        r"cannot reach|failed to connect|connection refused", message, re.IGNORECASE) is not None


def dead_daemon_worker(rank: int, world_size: int, addresses: list[str],
                       init_file: str) -> dict:
    """Every entry point of the shim, against a daemon address where nothing listens."""
    torch.set_num_threads(1)
    client = ReducerClient(addresses, job=uuid.uuid4().hex, rank=rank, world_size=world_size,
                           timeout=TIMEOUT_S)
    out = {"allreduce": _outcome(lambda: rt.allreduce(torch.ones(1000), "x", reducer=client))}

    model = make_model("mlp")
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), reducer=client)

    def optimizer_step() -> None:
        x, y = batch("mlp", 0, rank)
        loss_of("mlp", model(x), y).backward()
        opt.step()
    out["optimizer"] = _outcome(optimizer_step)

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        ddp = DDP(make_model("mlp"))
        ddp.register_comm_hook(state=client, hook=rt.allreduce_hook)

        def ddp_backward() -> None:
            x, y = batch("mlp", 0, rank)
            loss_of("mlp", ddp(x), y).backward()
        out["ddp"] = _outcome(ddp_backward)
    finally:
        dist.destroy_process_group()
        client.close()
    return out


def test_daemon_down_raises(daemons, tmp_path):
    """Scenario: the only daemon is gone before training starts.

    allreduce and DistributedOptimizer.step raise ReducerError (UNAVAILABLE:
    the client names the daemon it cannot reach); DDP's backward raises the
    hook's error (a RuntimeError quoting the ReducerError) after the client
    timeout.
    """
    with daemons(1) as d:
        addresses = d.addresses
        d.processes[0].stop()
    [result] = run_workers(dead_daemon_worker, 1, (addresses, str(tmp_path / "pg")),
                           timeout=60)
    for entry, (error_type, code, message, seconds) in result.items():
        print(f"{entry}: {error_type} {code} after {seconds:.1f} s (timeout {TIMEOUT_S} s): "
              f"{message.splitlines()[0]}")
    assert result["allreduce"][:2] == ("ReducerError", "UNAVAILABLE")
    assert result["optimizer"][:2] == ("ReducerError", "UNAVAILABLE")
    # DDP re-raises the hook's error from C++ as a RuntimeError that quotes it.
    assert result["ddp"][0] == "RuntimeError", result["ddp"]
    assert "ReducerError" in result["ddp"][2]
    for entry, (_, _, message, seconds) in result.items():
        assert _names_the_unreachable_daemon(message, addresses[0]), (entry, message)
        assert seconds <= TIMEOUT_S + SLACK_S, (entry, seconds)


def killed_daemon_worker(rank: int, world_size: int, addresses: list[str], job: str,
                         progress_dir: str) -> dict:
    """Train until a reduction fails; say when 3 steps are done (the test then kills a daemon)."""
    torch.set_num_threads(1)
    # 1 KiB chunks: the MLP's one small bucket is then spread over both daemons,
    # so every step needs the one that is killed (under a chunk's floor per
    # daemon it would go to one daemon, by its key's CRC).
    client = ReducerClient(addresses, job=job, rank=rank, world_size=world_size,
                           timeout=TIMEOUT_S, chunk_bytes=1024)
    model = make_model("mlp")
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(), reducer=client)
    steps = 0
    try:
        while steps < 100_000:
            x, y = batch("mlp", steps % 10, rank)
            opt.zero_grad()
            loss_of("mlp", model(x), y).backward()
            started = time.monotonic()
            try:
                opt.step()
            except ReducerError as exc:
                return {"steps": steps, "code": exc.code.name, "message": str(exc),
                        "seconds": time.monotonic() - started}
            steps += 1
            if steps == 3:
                (Path(progress_dir) / f"rank{rank}").touch()
        return {"steps": steps, "code": None, "message": "", "seconds": 0.0}
    finally:
        client.close()


def _kill_when_training(daemon, progress_dir: Path, world_size: int,
                        stop: threading.Event) -> None:
    while not stop.wait(0.05):
        if len(list(progress_dir.iterdir())) == world_size:
            daemon.stop(signal.SIGKILL)
            return


def test_daemon_killed_during_training(daemons, tmp_path):
    """Scenario: once both workers have trained 3 steps, one of two daemons is SIGKILLed.

    Each worker's next step() raises ReducerError UNAVAILABLE naming the
    killed daemon (and only it) within the client's timeout, instead of
    waiting for ever.
    """
    progress = tmp_path / "progress"
    progress.mkdir()
    stop = threading.Event()
    with daemons(2, round_timeout=30) as d:
        killer = threading.Thread(target=_kill_when_training,
                                  args=(d.processes[1], progress, 2, stop))
        killer.start()
        try:
            results = run_workers(killed_daemon_worker, 2,
                                  (d.addresses, uuid.uuid4().hex, str(progress)), timeout=120)
        finally:
            stop.set()
            killer.join()
    killed, alive = d.addresses[1], d.addresses[0]
    for rank, result in enumerate(results):
        print(f"rank {rank}: {result['steps']} steps, then {result['code']} after "
              f"{result['seconds']:.1f} s: {result['message']}")
        assert result["steps"] >= 3
        assert result["code"] == "UNAVAILABLE", result
        assert _names_the_unreachable_daemon(result["message"], killed), result
        assert alive not in result["message"], result
        assert result["seconds"] <= TIMEOUT_S + SLACK_S, result
